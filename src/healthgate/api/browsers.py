"""What a web browser may do with the API (SPEC §7, "Browsers").

A browser on this machine reaches the loopback API too - and runs whatever
page it was given. Without this guard, a page from anywhere could POST a
manifest to ``http://127.0.0.1:7400/v1/apply`` as ``text/plain`` (a
"simple" request: no preflight), and on a loopback server without tokens
that request is the local admin; a page on a name that resolves to
127.0.0.1 (DNS rebinding) could even read the answers. So, for every
request, before any route:

* **Host** must name this API: an IP address literal (which no DNS
  rebinding can produce), ``localhost``, or a name given with
  ``--allowed-host`` - else 403 naming the option;
* **Origin**, when a browser sends one, must be the API's own: the same
  host and port the request was sent to - else 403 (``Origin: null``, a
  sandboxed page's, included);
* **writes** (POST, PUT, PATCH, DELETE) that carry a body must say it is
  ``application/json`` or YAML (``application/yaml``, ``application/x-yaml``,
  ``text/yaml``) - else 415: the content types a page can send without a
  preflight (``text/plain``, forms) are refused, and a page that asks for
  another one is refused by the browser's preflight, which the API does not
  answer with any ``Access-Control-Allow-*``.

Clients that are not browsers (the CLI, curl, scripts, load balancers'
checks) send no Origin and an IP or an allowed name as Host. A loopback
server without tokens still trusts every local user and process; the
threat model in docs/operations.md says so.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from healthgate.api.errors import error_response

WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
BODY_TYPES = frozenset({"application/json", "application/yaml", "application/x-yaml", "text/yaml"})


def _split_host(value: str) -> tuple[str, str]:
    """(host, port) of a Host header value or an origin's netloc ('' when absent)."""
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        return host.lower(), rest.removeprefix(":")
    host, _, port = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
    return host.lower(), port


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class BrowserGuard:
    """ASGI middleware enforcing the module doc's rules."""

    def __init__(self, app: ASGIApp, allowed_hosts: tuple[str, ...] = ()) -> None:
        self.app = app
        self.allowed = frozenset(h.lower().rstrip(".") for h in allowed_hosts) | {"localhost"}

    def host_allowed(self, host: str) -> bool:
        return _is_ip(host) or host.rstrip(".") in self.allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        refusal = self.check(scope.get("method", "GET"), headers)
        if refusal is not None:
            await error_response(*refusal)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def check(self, method: str, headers: dict[bytes, bytes]) -> tuple[int, str] | None:
        host_value = headers.get(b"host", b"").decode("latin-1").strip()
        host, port = _split_host(host_value)
        if not host or not self.host_allowed(host):
            return (
                403,
                f"Host {host_value[:100]!r} does not name this API: use its address, "
                "localhost, or a name given to serve with --allowed-host",
            )
        origin = headers.get(b"origin")
        if origin is not None:
            parts = urlsplit(origin.decode("latin-1"))
            o_host, o_port = _split_host(parts.netloc)
            default = {"http": "80", "https": "443"}.get(parts.scheme, "")
            if (
                parts.scheme not in ("http", "https")
                or o_host != host
                or (o_port or default) != (port or default)
            ):
                return 403, "cross-origin requests are refused (Origin is not this API's own)"
        if method in WRITES and _has_body(headers):
            ctype = headers.get(b"content-type", b"").decode("latin-1").split(";")[0]
            if ctype.strip().lower() not in BODY_TYPES:
                return (
                    415,
                    "a request body must be application/json or application/yaml "
                    f"(got {ctype[:60] or 'no Content-Type'!r})",
                )
        return None


def _has_body(headers: dict[bytes, bytes]) -> bool:
    length = headers.get(b"content-length")
    if length is not None:
        return length.strip() not in (b"", b"0")
    return b"transfer-encoding" in headers
