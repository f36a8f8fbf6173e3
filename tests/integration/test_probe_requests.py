"""SPEC §10's probe requests, one table run against every probe path.

Method, headers and body; TCP send/expect; the PROXY protocol preamble; a
client certificate and a CA - each against a real server on loopback that
answers only what is right, through the coroutine prober and the batch
prober (the C reader's path), each fresh and kept alive (the second probe
then rides the first one's connection: a preamble must not be sent again).
The paths beyond these (probe workers, a cluster node) build the same
ProbeSpec from the same resource: tests/e2e/test_probe_requests.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
from typing import Any

import pytest
import trustme

from healthgate.health.states import Outcome, ProbeResult
from healthgate.model.validation import parse_resource
from healthgate.probes.prober import ProbeSettings
from healthgate.probes.spec import PROXY_PREAMBLES, ProbeSpec
from tests.helpers import run_async
from tests.integration import servers
from tests.integration.servers import Server, read_proxy_header
from tests.integration.test_probes import PROBERS, spec

V1, V2 = PROXY_PREAMBLES["PROXY_V1"], PROXY_PREAMBLES["PROXY_V2"]
AUTH = {"Authorization": "Bearer 3q2+7w", "X-Tenant": "shop"}
AUTH_HEADERS = tuple(AUTH.items())

# (case, server, check type, ProbeSpec fields, outcome)
CASES: list[tuple[str, servers.Handler, str, dict[str, Any], Outcome]] = [
    ("headers right", servers.demanding(headers=AUTH), "HTTP", {"headers": AUTH_HEADERS},
     Outcome.OK),
    ("headers missing", servers.demanding(headers=AUTH), "HTTP", {}, Outcome.STATUS),
    ("header wrong", servers.demanding(headers=AUTH), "HTTP",
     {"headers": (("Authorization", "Bearer nope"), ("X-Tenant", "shop"))}, Outcome.STATUS),
    ("POST with body", servers.demanding("POST", body=b'{"q":1}'), "HTTP",
     {"method": "POST", "body": b'{"q":1}'}, Outcome.OK),
    ("POST wrong body", servers.demanding("POST", body=b'{"q":1}'), "HTTP",
     {"method": "POST", "body": b'{"q":2}'}, Outcome.STATUS),
    ("GET where POST is wanted", servers.demanding("POST"), "HTTP", {}, Outcome.STATUS),
    ("HEAD", servers.demanding("HEAD"), "HTTP", {"method": "HEAD"}, Outcome.OK),
    ("PUT", servers.demanding("PUT"), "HTTP", {"method": "PUT"}, Outcome.OK),
    ("OPTIONS", servers.demanding("OPTIONS"), "HTTP", {"method": "OPTIONS"}, Outcome.OK),
    ("HTTP behind PROXY v1", servers.demanding(proxy=True), "HTTP", {"preamble": V1},
     Outcome.OK),
    ("HTTP behind PROXY v2", servers.demanding(proxy=True), "HTTP", {"preamble": V2},
     Outcome.OK),
    ("HTTP to PROXY without it", servers.demanding(proxy=True), "HTTP", {}, Outcome.RESET),
    ("PING +PONG", servers.redis_like(), "TCP",
     {"send": b"PING\r\n", "expect": b"+PONG"}, Outcome.OK),
    ("PING wrong answer", servers.redis_like(), "TCP",
     {"send": b"PONG\r\n", "expect": b"+PONG"}, Outcome.CONTENT),
    ("PING +PONG as hex", servers.redis_like(), "TCP",
     {"send": bytes.fromhex("50494e470d0a"), "expect": bytes.fromhex("2b504f4e47")}, Outcome.OK),
    ("banner", servers.banner(b"220 mail ready\r\n"), "TCP", {"expect": b"220 "}, Outcome.OK),
    ("banner wrong", servers.banner(b"554 go away\r\n"), "TCP", {"expect": b"220 "},
     Outcome.CONTENT),
    ("banner never comes", servers.hang, "TCP", {"expect": b"220 ", "timeout": 0.3},
     Outcome.TIMEOUT),
    ("answer shorter than expected, then closed", servers.banner(b"+PO", then_close=True), "TCP",
     {"expect": b"+PONG"}, Outcome.CONTENT),
    ("send only", servers.redis_like(), "TCP", {"send": b"PING\r\n"}, Outcome.OK),
    ("TCP behind PROXY v1", servers.redis_like(proxy=True), "TCP",
     {"preamble": V1, "send": b"PING\r\n", "expect": b"+PONG"}, Outcome.OK),
    ("TCP behind PROXY v2", servers.redis_like(proxy=True), "TCP",
     {"preamble": V2, "send": b"PING\r\n", "expect": b"+PONG"}, Outcome.OK),
    # (a listener waits for the 16 bytes of a v2 header that six bytes could begin)
    ("TCP to PROXY without it", servers.redis_like(proxy=True), "TCP",
     {"send": b"PING\r\n", "expect": b"+PONG", "timeout": 0.3}, Outcome.TIMEOUT),
]  # fmt: skip

PATHS = ["coroutine", "batch", "coroutine kept alive", "batch kept alive"]


def probe_twice(
    handler: servers.Handler, kind: str, path: str, kw: dict[str, Any]
) -> tuple[list[ProbeResult], int]:
    """Probe twice with one key (a kept-alive path reuses its connection
    when the answer allows); the results and the server's connection count."""
    keepalive = path.endswith("kept alive")
    settings = ProbeSettings(keepalive=keepalive)
    timeout = kw.pop("timeout", 1.0)

    async def go() -> tuple[list[ProbeResult], int]:
        prober = PROBERS[path.split(maxsplit=1)[0]](settings)
        try:
            async with Server(handler) as srv:
                check = spec(kind, srv.port, timeout=timeout, **kw)
                results = [await prober.probe(check, "key") for _ in range(2)]
                return results, srv.connections
        finally:
            await prober.close()

    out: tuple[list[ProbeResult], int] = run_async(go())
    return out


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("case", "handler", "kind", "kw", "outcome"), CASES, ids=[c[0] for c in CASES]
)
def test_what_a_probe_sends(
    case: str, handler: servers.Handler, kind: str, kw: dict[str, Any], outcome: Outcome, path: str
) -> None:
    results, connections = probe_twice(handler, kind, path, dict(kw))
    assert [r.outcome for r in results] == [outcome, outcome], (case, results)
    if outcome is Outcome.OK and kind == "HTTP" and path.endswith("kept alive"):
        assert connections == 1  # the second probe rode the first one's connection


def test_the_proxy_preamble_opens_each_connection_once() -> None:
    """Kept alive, the preamble goes first on the connection and never
    again; fresh, first on each."""
    for path, connections in (("batch kept alive", 1), ("batch", 2), ("coroutine", 2)):
        seen: list[bytes] = []
        handler = servers.demanding(proxy=True, seen=seen)
        results, count = probe_twice(handler, "HTTP", path, {"preamble": V2})
        assert [r.outcome for r in results] == [Outcome.OK] * 2
        assert count == connections
        assert sum(1 for s in seen if s.startswith(servers.PROXY_V2_SIGNATURE)) == connections
        assert sum(1 for s in seen if s.startswith(b"GET ")) == 2


def test_a_wrong_answer_names_what_was_expected_and_what_came() -> None:
    results, _ = probe_twice(
        servers.redis_like(), "TCP", "batch", {"send": b"FLUSH\r\n", "expect": b"+PONG"}
    )
    assert results[0].detail == "expected b'+PONG', got b'-ERR '"


# ------------------------------------------------------------------ HTTPS: client certificates


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def mtls_server(ca: trustme.CA) -> ssl.SSLContext:
    """A server that requires a client certificate issued by ``ca``."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("web.internal").configure_cert(ctx)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ca.configure_trust(ctx)
    return ctx


def client_pem(ca: trustme.CA) -> str:
    return ca.issue_cert("prober.internal").private_key_and_cert_chain_pem.bytes().decode()


def https_twice(
    ctx: ssl.SSLContext, keepalive: bool, proxy: bool = False, **kw: Any
) -> list[ProbeResult]:
    async def go() -> list[ProbeResult]:
        prober = PROBERS["coroutine"](ProbeSettings(keepalive=keepalive))
        try:
            if proxy:  # TLS after the preamble
                return await _behind_proxy(prober, ctx, kw)
            async with Server(servers.demanding(), tls=ctx) as srv:
                check = spec("HTTPS", srv.port, host="web.internal", **kw)
                return [await prober.probe(check, "key") for _ in range(2)]
        finally:
            await prober.close()

    out: list[ProbeResult] = run_async(go())
    return out


async def _behind_proxy(prober: Any, ctx: ssl.SSLContext, kw: dict[str, Any]) -> list[ProbeResult]:
    """HTTPS behind a PROXY v1 listener: a thread that reads the preamble a
    byte at a time off the socket (the ClientHello stays in the kernel for
    TLS; asyncio's start_tls would lose what its reader already took), then
    answers each request on the connection."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(5)
    preambles: list[bytes] = []

    def serve() -> None:
        with contextlib.suppress(OSError):
            for _ in range(2):  # bounded: the probes' connections
                conn, _ = listener.accept()
                conn.settimeout(5)
                line = b""
                while not line.endswith(b"\r\n") and len(line) < 108:
                    line += conn.recv(1)
                preambles.append(line)
                with ctx.wrap_socket(conn, server_side=True) as tls:
                    for _ in range(2):
                        head = b""
                        while not head.endswith(b"\r\n\r\n") and len(head) < 8192:
                            head += tls.recv(1)
                        if not head:
                            break
                        tls.sendall(b"HTTP/1.1 200 X\r\nContent-Length: 2\r\n\r\nok")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        check = spec("HTTPS", listener.getsockname()[1], host="web.internal", **kw)
        results = [await prober.probe(check, "key") for _ in range(2)]
    finally:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # (wakes the accept)
        listener.close()
    await asyncio.to_thread(thread.join, 5)
    assert preambles[:1] == [V1]
    return results


@pytest.mark.parametrize("keepalive", [False, True], ids=["fresh", "kept alive"])
def test_https_with_a_client_certificate(ca: trustme.CA, keepalive: bool) -> None:
    server = mtls_server(ca)
    ok = https_twice(server, keepalive, client_cert=client_pem(ca))
    assert [r.outcome for r in ok] == [Outcome.OK] * 2
    without = https_twice(server, keepalive)
    assert all(r.outcome in (Outcome.TLS, Outcome.RESET) for r in without), without
    stranger = https_twice(server, keepalive, client_cert=client_pem(trustme.CA()))
    assert all(r.outcome in (Outcome.TLS, Outcome.RESET) for r in stranger), stranger


def test_https_verified_against_the_checks_own_ca(ca: trustme.CA) -> None:
    server = mtls_server(ca)
    pem, cert = ca.cert_pem.bytes().decode(), client_pem(ca)
    right = https_twice(server, False, verify=True, ca=pem, client_cert=cert)
    assert [r.outcome for r in right] == [Outcome.OK] * 2
    other = trustme.CA().cert_pem.bytes().decode()
    wrong = https_twice(server, False, verify=True, ca=other, client_cert=cert)
    assert [r.outcome for r in wrong] == [Outcome.TLS] * 2
    assert "CERTIFICATE_VERIFY_FAILED" in wrong[0].detail
    # verify with no CA of its own: the system store, which does not know this one
    system = https_twice(server, False, verify=True, client_cert=cert)
    assert [r.outcome for r in system] == [Outcome.TLS] * 2


def test_https_behind_the_proxy_protocol(ca: trustme.CA) -> None:
    server = mtls_server(ca)
    results = https_twice(server, True, proxy=True, preamble=V1, client_cert=client_pem(ca))
    assert [r.outcome for r in results] == [Outcome.OK] * 2


def test_a_client_certificate_that_does_not_load_says_so() -> None:
    results = https_twice(
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER),
        False,
        client_cert="-----BEGIN CERTIFICATE-----\nx\n",
    )
    assert results[0].outcome is Outcome.TLS


# ------------------------------------------------------------------ from the resource


def test_the_spec_takes_every_field_from_the_check_and_its_secrets() -> None:
    check, issues = parse_resource(
        {
            "kind": "HealthCheck", "name": "hc", "project": "p", "region": "r1", "type": "HTTPS",
            "method": "POST", "requestBody": "{}", "proxyHeader": "PROXY_V2",
            "requestHeaders": [
                {"name": "Authorization", "valueFrom": {"secret": "token"}},
                {"name": "X-Tenant", "value": "shop"},
            ],
            "clientCertificate": {"secret": "global/secrets/cert"},
            "verify": True, "caCertificate": {"secret": "ca"},
        }
    )  # fmt: skip
    assert check is not None, issues
    from healthgate.model.names import ResourcePath

    secrets = {
        ResourcePath("p", "r1", "secrets", "token"): "Bearer 3q2+7w",
        ResourcePath("p", "global", "secrets", "cert"): "CERT AND KEY",
        ResourcePath("p", "r1", "secrets", "ca"): "CA",
    }
    s = ProbeSpec.from_check(check, "10.0.0.1", 443, secrets)  # type: ignore[arg-type]
    assert (s.method, s.body, s.preamble) == ("POST", b"{}", V2)
    assert s.headers == (("Authorization", "Bearer 3q2+7w"), ("X-Tenant", "shop"))
    assert (s.verify, s.ca, s.client_cert) == (True, "CA", "CERT AND KEY")
    assert "3q2" not in repr(s) and "CERT AND KEY" not in repr(s)  # never shown
    with pytest.raises(ValueError, match="not there"):
        ProbeSpec.from_check(check, "10.0.0.1", 443, {})  # type: ignore[arg-type]


# ------------------------------------------------------------------ gRPC over TLS


def grpc_tls_probe(issuer: trustme.CA, require_client: bool, **kw: Any) -> list[ProbeResult]:
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    cert = issuer.issue_cert("grpc.internal")

    async def go() -> list[ProbeResult]:
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        credentials = grpc.ssl_server_credentials(
            [(cert.private_key_pem.bytes(), cert.cert_chain_pems[0].bytes())],
            root_certificates=issuer.cert_pem.bytes() if require_client else None,
            require_client_auth=require_client,
        )
        port = server.add_secure_port("127.0.0.1:0", credentials)
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        await server.start()
        prober = PROBERS["coroutine"](ProbeSettings())
        try:
            check = spec("GRPC", port, timeout=2.0, host="grpc.internal", **kw)
            return [await prober.probe(check, "g") for _ in range(2)]
        finally:
            await prober.close()
            await server.stop(None)

    out: list[ProbeResult] = run_async(go())
    return out


def test_grpc_over_tls_verified_with_a_client_certificate(ca: trustme.CA) -> None:
    pem = ca.cert_pem.bytes().decode()
    ok = grpc_tls_probe(ca, True, verify=True, ca=pem, client_cert=client_pem(ca))
    assert [r.outcome for r in ok] == [Outcome.OK] * 2, ok
    server_only = grpc_tls_probe(ca, False, verify=True, ca=pem)
    assert [r.outcome for r in server_only] == [Outcome.OK] * 2, server_only
    no_cert = grpc_tls_probe(ca, True, verify=True, ca=pem)
    assert all(r.outcome is not Outcome.OK for r in no_cert), no_cert
    other = trustme.CA().cert_pem.bytes().decode()
    wrong_ca = grpc_tls_probe(ca, False, verify=True, ca=other)
    assert all(r.outcome is not Outcome.OK for r in wrong_ca), wrong_ca
    plain = grpc_tls_probe(ca, False)  # (no verify: plaintext, which a TLS server refuses)
    assert all(r.outcome is not Outcome.OK for r in plain), plain


def test_an_encrypted_client_key_fails_as_tls_and_never_prompts(ca: trustme.CA) -> None:
    """(OpenSSL would ask the terminal for the passphrase: serve must not wait on it.)"""
    from cryptography.hazmat.primitives import serialization

    cert = ca.issue_cert("prober.internal")
    key = serialization.load_pem_private_key(cert.private_key_pem.bytes(), password=None)
    encrypted = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"passphrase"),
    ).decode()
    pem = encrypted + cert.cert_chain_pems[0].bytes().decode()
    results = https_twice(mtls_server(ca), False, client_cert=pem)
    assert [r.outcome for r in results] == [Outcome.TLS] * 2, results


# ------------------------------------------------------------------ gRPC behind PROXY


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


def grpc_behind_proxy(
    preamble: bytes, key: str | None, seen: list[bytes], probes: int = 2
) -> list[ProbeResult]:
    """A gRPC health server behind a PROXY-protocol listener (the preamble
    first on each connection, or it closes), probed ``probes`` times."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    async def go() -> list[ProbeResult]:
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        grpc_port = server.add_insecure_port("127.0.0.1:0")
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        await server.start()

        async def front(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                got = await read_proxy_header(reader)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                got = None
            if got is None:
                writer.close()
                return
            seen.append(got)
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", grpc_port)
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

        listener = await asyncio.start_server(front, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        prober = PROBERS["coroutine"](ProbeSettings())
        try:
            check = spec("GRPC", port, timeout=2.0, preamble=preamble)
            return [await prober.probe(check, key) for _ in range(probes)]
        finally:
            await prober.close()
            listener.close()
            await server.stop(None)

    out: list[ProbeResult] = run_async(go())
    return out


@pytest.mark.parametrize("key", ["g", None], ids=["kept channel", "a channel per probe"])
@pytest.mark.parametrize("version", ["PROXY_V1", "PROXY_V2"])
def test_grpc_behind_a_proxy_protocol_listener(version: str, key: str | None) -> None:
    """gRPC's client opens its own connections: the preamble goes first on
    each through a relay (probes/grpc.py). A kept channel is one connection
    (one preamble for both probes); a channel per probe, one each."""
    seen: list[bytes] = []
    preamble = PROXY_PREAMBLES[version]
    results = grpc_behind_proxy(preamble, key, seen)
    assert [r.outcome for r in results] == [Outcome.OK] * 2, results
    assert seen == [preamble] * (1 if key else 2)


def test_grpc_without_the_preamble_a_proxy_listener_refuses() -> None:
    seen: list[bytes] = []
    results = grpc_behind_proxy(b"", "g", seen, probes=1)
    assert results[0].outcome is not Outcome.OK and seen == [], results
