"""How far a front end's last route decision has travelled (SPEC §11).

``GET`` of a consumer forwarding rule carries ``status.decision`` (the
generation, when, what) and ``status.convergence``: every data plane that
applied it (``appliedAfterMs``) and every one expected to that has not yet
(``appliedAfterMs: null``, with ``waitingMs`` and ``lastSeen``).

In a cluster each node tracks its own data planes; a node answering the
GET asks the other live nodes for theirs (``GET .../convergence?scope=node``,
with the caller's own token, at most ``PEER_TIMEOUT`` seconds each, all at
once) and merges the receipts of those on the same decision. No etcd write
is made for it: a node's address is in its member key, written once when
it joins. ``status.convergenceNodes`` says, per other node, whether it
answered and on which decision it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

import httpx
from fastapi import APIRouter, Query

from healthgate.api.state import ApiState, Auth
from healthgate.model.names import GLOBAL

PEER_TIMEOUT = 0.5  # seconds a node waits for another's receipts
MAX_PEER_ANSWER = 1 << 20  # bytes of one node's answer

ScopeQ = Annotated[
    Literal["node", "cluster"],
    Query(description="node: this node's data planes only; cluster: every live node's"),
]


async def peer_views(
    peers: Mapping[str, str], path: str, authorization: str | None
) -> dict[str, dict[str, Any] | str]:
    """Each other node's own view (or why there is none)."""
    headers = {"Authorization": authorization} if authorization else {}

    async def ask(client: httpx.AsyncClient, url: str) -> dict[str, Any] | str:
        try:
            async with client.stream(
                "GET", f"{url}/v1/{path}/convergence", params={"scope": "node"}, headers=headers
            ) as response:
                body = b""
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_PEER_ANSWER:
                        return "answer too large"
                if response.status_code != 200:
                    return f"HTTP {response.status_code}"
                answer = httpx.Response(200, content=body).json()
                return answer if isinstance(answer, dict) else "not an answer"
        except (httpx.HTTPError, ValueError) as exc:
            return f"unreachable ({type(exc).__name__})"

    async with httpx.AsyncClient(
        timeout=PEER_TIMEOUT, follow_redirects=False, trust_env=False
    ) as client:
        names = sorted(peers)
        got = await asyncio.gather(*(ask(client, peers[n]) for n in names))
    return dict(zip(names, got, strict=True))


def merge(own: dict[str, Any] | None, peers: Mapping[str, dict[str, Any] | str]) -> dict[str, Any]:
    """This node's decision and receipts, with those of the other nodes on the same decision."""
    receipts = list((own or {}).get("receipts", []))
    nodes: dict[str, str] = {}
    decided = (own or {}).get("decidedAt")
    for node, view in peers.items():
        if isinstance(view, str):
            nodes[node] = view
        elif view.get("decidedAt") != decided:
            nodes[node] = f"on the decision of {view.get('decidedAt') or 'none yet'}"
        else:
            nodes[node] = "same decision"
            receipts += [r for r in view.get("receipts", []) if isinstance(r, dict)]
    receipts.sort(key=lambda r: (r.get("appliedAfterMs") is None, r.get("appliedAfterMs") or 0))
    return {"receipts": receipts, "nodes": nodes}


def convergence_router(state: ApiState) -> APIRouter:
    router = APIRouter(tags=["convergence"])

    @router.get("/v1/projects/{project}/global/forwardingRules/{name}/convergence")
    async def convergence(
        project: str, name: str, authorization: Auth = None, scope: ScopeQ = "cluster"
    ) -> dict[str, Any]:
        """The front end's last route decision and who has applied it."""
        state.check_read(state.principal(authorization), project)
        path = state.path_of(project, GLOBAL, "forwardingRules", name)
        state.stored(path)  # (NOT_FOUND when it is not there)
        own = state.convergence.status(str(path)) if state.convergence is not None else None
        out: dict[str, Any] = {"node": state.convergence.own if state.convergence else ""}
        out.update(own or {"receipts": []})
        if scope == "cluster" and state.peers is not None:
            merged = merge(own, await peer_views(state.peers(), str(path), authorization))
            out["receipts"], out["nodes"] = merged["receipts"], merged["nodes"]
        return out

    return router


async def with_peers(
    state: ApiState, body: dict[str, Any], authorization: str | None
) -> dict[str, Any]:
    """A global forwarding rule's GET in a cluster: the other nodes'
    receipts merged into its ``status.convergence``."""
    peers: Callable[[], dict[str, str]] | None = state.peers
    status = body.get("status")
    if peers is None or not isinstance(status, dict) or "decision" not in status:
        return body
    own = {**status["decision"], "receipts": status.get("convergence", [])}
    merged = merge(own, await peer_views(peers(), body["selfLink"], authorization))
    status["convergence"], status["convergenceNodes"] = merged["receipts"], merged["nodes"]
    return body
