"""gRPC probes: the standard ``grpc.health.v1.Health/Check``.

Uses grpcio's asyncio API and the generated stubs of grpcio-health-checking.
A channel is kept per key (gRPC channels reconnect by themselves and a fresh
HTTP/2 connection per probe would mostly measure grpcio's set-up cost).
``SERVING`` is success; ``NOT_SERVING``, ``SERVICE_UNKNOWN`` or an unknown
service (``NOT_FOUND``) are failures with that reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import tempfile
import uuid
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


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


class _Relay:
    """gRPC's client opens its own connections, so the PROXY preamble of a
    check (SPEC §10) cannot go first on them: such a check's channel
    connects to this instead - a Unix socket in a directory only this
    process's user may enter - and each connection is joined to the
    endpoint with the preamble written first."""

    def __init__(self, spec: ProbeSpec, directory: str) -> None:
        self.ip, self.port, self.preamble = spec.ip, spec.port, spec.preamble
        self.timeout = spec.timeout
        self.path = os.path.join(directory, f"{uuid.uuid4().hex[:12]}.sock")
        self.server: asyncio.AbstractServer | None = None
        self._joins: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_unix_server(self._join, self.path)
        return f"unix:{self.path}"

    async def _join(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._joins.add(task)
        try:
            async with asyncio.timeout(self.timeout):
                up_reader, up_writer = await asyncio.open_connection(self.ip, self.port)
        except (OSError, TimeoutError):
            writer.close()  # (the probe then fails UNAVAILABLE)
            return
        try:
            up_writer.write(self.preamble)
            await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        finally:
            if task is not None:
                self._joins.discard(task)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self._joins):
            task.cancel()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class GrpcHealthProber:
    def __init__(self, ca_file: str | None = None) -> None:
        self.ca_file = ca_file  # serve --ca-file: the CA of a verified check without its own
        # by key: what the channel was made for (target, TLS, preamble), the
        # channel, and its relay (a check with a PROXY preamble)
        self._channels: dict[
            Any, tuple[tuple[str, bool, str, str, bytes], grpc.aio.Channel, _Relay | None]
        ] = {}
        self._directory: str | None = None  # the relays' (made at the first)
        self._retiring: set[asyncio.Task[None]] = set()

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

    async def _channel(self, spec: ProbeSpec, key: Any) -> tuple[grpc.aio.Channel, _Relay | None]:
        target = spec.address
        made_for = (target, spec.verify, spec.ca, spec.client_cert, spec.preamble)
        cached = self._channels.get(key) if key is not None else None
        if cached is not None and cached[0] == made_for:
            return cached[1], cached[2]
        options: list[tuple[str, Any]] = [("grpc.enable_retries", 0)]
        relay = None
        if spec.preamble:
            if self._directory is None:
                self._directory = tempfile.mkdtemp(prefix="healthgate-grpc-")  # (mode 0700)
            relay = _Relay(spec, self._directory)
            target = await relay.start()
        if spec.host or relay is not None:
            options.append(("grpc.default_authority", spec.host or spec.address))
            if spec.verify:
                options.append(("grpc.ssl_target_name_override", spec.host or spec.ip))
        if spec.verify:
            channel = grpc.aio.secure_channel(target, self._credentials(spec), options=options)
        else:
            channel = grpc.aio.insecure_channel(target, options=options)
        if key is not None:
            if cached is not None:
                self._retire(cached[1], cached[2])
            self._channels[key] = (made_for, channel, relay)
        return channel, relay

    def _retire(self, channel: grpc.aio.Channel, relay: _Relay | None) -> None:
        """Close a channel (and its relay) no longer used, in the background."""

        async def retire() -> None:
            await channel.close(None)
            if relay is not None:
                await relay.close()

        task = asyncio.get_running_loop().create_task(retire())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def probe(self, spec: ProbeSpec, key: Any, start: float) -> ProbeResult:
        loop = asyncio.get_running_loop()
        channel, relay = await self._channel(spec, key)
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
                if relay is not None:
                    await relay.close()
        latency = loop.time() - start
        status = reply.status
        if status == health_pb2.HealthCheckResponse.SERVING:
            return ProbeResult(Outcome.OK, latency)
        return ProbeResult(Outcome.STATUS, latency, 0, _STATUS_NAMES.get(status, str(status)))

    def forget(self, key: Any) -> None:
        cached = self._channels.pop(key, None)
        if cached is not None:
            self._retire(cached[1], cached[2])

    async def close(self) -> None:
        held = list(self._channels.values())
        self._channels.clear()
        for _, channel, relay in held:
            await channel.close(None)
            if relay is not None:
                await relay.close()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
