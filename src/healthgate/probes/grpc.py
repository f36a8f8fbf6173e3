"""gRPC probes: the standard ``grpc.health.v1.Health/Check``.

Uses grpcio's asyncio API and the generated stubs of grpcio-health-checking.
A channel is kept per key (gRPC channels reconnect by themselves and a fresh
HTTP/2 connection per probe would mostly measure grpcio's set-up cost).
``SERVING`` is success; ``NOT_SERVING``, ``SERVICE_UNKNOWN`` or an unknown
service (``NOT_FOUND``) are failures with that reason.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from healthgate.health.states import Outcome, ProbeResult
from healthgate.probes.spec import ProbeSpec

_STATUS_NAMES = {v: k for k, v in health_pb2.HealthCheckResponse.ServingStatus.items()}


_PEM_KEY = re.compile(
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----\s*", re.S
)


def split_pem(pem: str) -> tuple[bytes, bytes]:
    """A client certificate's secret (PEM) as gRPC wants it: the private
    key, and the certificate chain (everything else)."""
    key = _PEM_KEY.search(pem)
    if key is None:
        return b"", pem.encode()
    return key.group(0).encode(), (pem[: key.start()] + pem[key.end() :]).encode()


class GrpcHealthProber:
    def __init__(self, ca_file: str | None = None) -> None:
        self.ca_file = ca_file  # serve --ca-file: the CA of a verified check without its own
        # by key: what the channel was made for (target and TLS), and the channel
        self._channels: dict[Any, tuple[tuple[str, bool, str, str], grpc.aio.Channel]] = {}

    def _credentials(self, spec: ProbeSpec) -> grpc.ChannelCredentials:
        """TLS for a check with ``verify`` (SPEC §10): gRPC's TLS always
        verifies the server, against the check's CA, serve's --ca-file, or
        the system's roots; with the check's client certificate."""
        roots: bytes | None = spec.ca.encode() if spec.ca else None
        if roots is None and self.ca_file:
            with open(self.ca_file, "rb") as f:
                roots = f.read()
        key, chain = split_pem(spec.client_cert) if spec.client_cert else (None, None)
        return grpc.ssl_channel_credentials(roots, key or None, chain or None)

    def _channel(self, spec: ProbeSpec, key: Any) -> grpc.aio.Channel:
        target = spec.address
        made_for = (target, spec.verify, spec.ca, spec.client_cert)
        cached = self._channels.get(key) if key is not None else None
        if cached is not None and cached[0] == made_for:
            return cached[1]
        options: list[tuple[str, Any]] = [("grpc.enable_retries", 0)]
        if spec.host:
            options.append(("grpc.default_authority", spec.host))
            if spec.verify:
                options.append(("grpc.ssl_target_name_override", spec.host))
        if spec.verify:
            channel = grpc.aio.secure_channel(target, self._credentials(spec), options=options)
        else:
            channel = grpc.aio.insecure_channel(target, options=options)
        if key is not None:
            if cached is not None:
                asyncio.get_running_loop().create_task(cached[1].close(None))
            self._channels[key] = (made_for, channel)
        return channel

    async def probe(self, spec: ProbeSpec, key: Any, start: float) -> ProbeResult:
        loop = asyncio.get_running_loop()
        channel = self._channel(spec, key)
        stub = health_pb2_grpc.HealthStub(channel)
        remaining = max(0.001, spec.timeout - (loop.time() - start))
        try:
            reply = await stub.Check(
                health_pb2.HealthCheckRequest(service=spec.grpc_service),
                timeout=remaining,
                wait_for_ready=False,
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            latency = loop.time() - start
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return ProbeResult(Outcome.TIMEOUT, latency)
            if code == grpc.StatusCode.NOT_FOUND:
                return ProbeResult(
                    Outcome.STATUS, latency, 0, f"unknown service {spec.grpc_service!r}"
                )
            if code == grpc.StatusCode.UNAVAILABLE:
                details = exc.details() or ""
                outcome = Outcome.REFUSED if "refused" in details.lower() else Outcome.ERROR
                return ProbeResult(outcome, latency, 0, f"UNAVAILABLE: {details}"[:200])
            return ProbeResult(Outcome.ERROR, latency, 0, f"{code.name}: {exc.details()}"[:200])
        finally:
            if key is None:
                await channel.close(None)
        latency = loop.time() - start
        status = reply.status
        if status == health_pb2.HealthCheckResponse.SERVING:
            return ProbeResult(Outcome.OK, latency)
        return ProbeResult(Outcome.STATUS, latency, 0, _STATUS_NAMES.get(status, str(status)))

    def forget(self, key: Any) -> None:
        cached = self._channels.pop(key, None)
        if cached is not None:
            asyncio.get_running_loop().create_task(cached[1].close(None))

    async def close(self) -> None:
        channels = [c for _, c in self._channels.values()]
        self._channels.clear()
        for channel in channels:
            await channel.close(None)
