"""Half-open TCP checks as raw SYNs (probes/syn.py), against real listeners
on loopback; and the connect-based fallback where raw sockets are not allowed."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Hashable

import pytest

from healthgate.health.states import Outcome, ProbeResult
from healthgate.probes.batch import BatchProber
from healthgate.probes.prober import ProbeSettings
from healthgate.probes.spec import ProbeSpec
from healthgate.probes.syn import SynPacket, can_open_raw
from tests.helpers import run_async
from tests.integration.servers import FullBacklog, free_port

raw = pytest.mark.skipif(not can_open_raw(), reason="needs root or CAP_NET_RAW")
HALF_OPEN = ProbeSettings(tcp_half_open=True)


def tcp(port: int, ip: str = "127.0.0.1", timeout: float = 1.0) -> ProbeSpec:
    return ProbeSpec(type="TCP", ip=ip, port=port, timeout=timeout, interval=1.0)


async def probe_all(
    batch: BatchProber, specs: dict[Hashable, ProbeSpec]
) -> dict[Hashable, ProbeResult]:
    """Start every probe at once, then poll every 2 ms as a tick would,
    until all have ended (bounded by the longest timeout and then some)."""
    loop = asyncio.get_running_loop()
    results: dict[Hashable, ProbeResult] = {}
    for key, spec in specs.items():
        result = batch.start(key, spec, loop.time())
        if result is not None:
            results[key] = result
    longest = max(s.timeout for s in specs.values())
    for _ in range(int(longest / 0.002) + 500):
        if len(results) == len(specs):
            break
        await asyncio.sleep(0.002)
        results.update(batch.poll(loop.time()))
    assert len(results) == len(specs), f"{len(specs) - len(results)} probes never ended"
    return results


def listeners(n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        out.append(s)
    return out


@raw
def test_checksum_matches_the_kernels_arithmetic() -> None:
    """The prebuilt SYN's checksum, updated per sequence number, sums to
    0xffff over the pseudo-header and the segment (RFC 793)."""
    packet = SynPacket("127.0.0.9", "10.1.2.3", 8080)
    for seq, sport in ((0, 40000), (1, 1), (0xFFFF, 65535), (0x10000, 32768),
                       (0xDEADBEEF, 40001), (0xFFFFFFFF, 12345)):  # fmt: skip
        segment = bytes(packet.stamp(seq, sport))
        pseudo = socket.inet_aton("127.0.0.9") + socket.inet_aton("10.1.2.3") + b"\x00\x06\x00\x18"
        data = pseudo + segment
        total = sum(int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data), 2))
        while total >> 16:
            total = (total & 0xFFFF) + (total >> 16)
        assert total == 0xFFFF, seq
        assert int.from_bytes(segment[4:8], "big") == seq
        assert int.from_bytes(segment[0:2], "big") == sport


@raw
def test_sequence_numbers_and_ports_cannot_be_guessed_from_the_last_probe() -> None:
    """Consecutive sequence numbers from one port let anyone who saw one
    probe forge the answer to the next (a reset: "refused"): each probe now
    draws a random number and one of several ports, and numbers in flight
    are never drawn twice."""
    from healthgate.probes.syn import SOURCE_PORTS, SynSocket

    syn = SynSocket.open("127.0.0.1")
    assert syn is not None
    try:
        packet = syn.packet("127.0.0.1", 9)
        sent = [syn.send(packet, "127.0.0.1") for _ in range(2000)]
        seqs = [seq for seq, _ in sent]
        steps = {(b - a) & 0xFFFFFFFF for a, b in itertools.pairwise(seqs)}
        assert len(steps) > 1990  # no step repeats (it was always 1)
        ports = {port for _, port in sent}
        assert len(ports) == SOURCE_PORTS == len(set(syn.ports))
        taken = {seqs[-1]}
        for _ in range(100):
            assert syn.send(packet, "127.0.0.1", taken)[0] not in taken
    finally:
        syn.close()


@raw
def test_raw_syn_outcomes_and_the_accept_queue_never_sees_them() -> None:
    """Open: OK; closed: REFUSED (the server's RST answers our SYN); a
    listener whose queue is full drops the SYN: TIMEOUT at the deadline.
    Probed many times over, no connection reaches an accept queue."""
    open_ = listeners(20)
    closed = [free_port() for _ in range(10)]

    async def go() -> tuple[dict[Hashable, ProbeResult], dict[Hashable, ProbeResult], int]:
        batch = BatchProber(HALF_OPEN)
        try:
            specs: dict[Hashable, ProbeSpec] = {}
            for i, s in enumerate(open_):
                specs[("open", i)] = tcp(s.getsockname()[1])
            for i, port in enumerate(closed):
                specs[("closed", i)] = tcp(port)
            rounds = [await probe_all(batch, specs) for _ in range(3)]
            with FullBacklog() as full:
                hung = await probe_all(batch, {"full": tcp(full.port, timeout=0.3)})
            assert batch._syn is not None, "the raw socket was not used"
            return rounds[-1], hung, len(batch._by_seq)
        finally:
            batch.close()

    try:
        results, hung, left = run_async(go(), timeout=30)
        for key, result in results.items():
            expected = Outcome.OK if key[0] == "open" else Outcome.REFUSED
            assert result.outcome is expected, (key, result)
        assert hung["full"].outcome is Outcome.TIMEOUT
        assert 0.295 <= hung["full"].latency < 0.6
        assert left == 0  # nothing stays in the sequence map
        accepted = 0
        for s in open_:
            s.setblocking(False)
            try:
                s.accept()[0].close()
                accepted += 1
            except BlockingIOError:
                pass
        assert accepted == 0
    finally:
        for s in open_:
            s.close()


@raw
def test_raw_syns_leave_from_the_source_address() -> None:
    """--probe-source: the SYN carries that address, and its checksum is
    summed over it (a wrong one would be dropped: a timeout, not OK)."""
    [listener] = listeners(1)

    async def go() -> ProbeResult:
        batch = BatchProber(ProbeSettings(tcp_half_open=True, source="127.0.0.9"))
        try:
            results = await probe_all(batch, {"k": tcp(listener.getsockname()[1])})
            return results["k"]
        finally:
            batch.close()

    try:
        assert run_async(go(), timeout=30).outcome is Outcome.OK
    finally:
        listener.close()


def test_without_raw_sockets_half_open_checks_connect_and_say_so() -> None:
    """raw_syn off (as when the process lacks CAP_NET_RAW): the connect-based
    half-open check, same outcomes, and the log says which one runs."""
    [listener] = listeners(1)
    closed = free_port()

    async def go() -> dict[Hashable, ProbeResult]:
        batch = BatchProber(ProbeSettings(tcp_half_open=True, raw_syn=False))
        try:
            results = await probe_all(
                batch, {"open": tcp(listener.getsockname()[1]), "closed": tcp(closed)}
            )
            assert batch._syn is None
            return results
        finally:
            batch.close()

    try:
        results = run_async(go(), timeout=30)
        assert results["open"].outcome is Outcome.OK
        assert results["closed"].outcome is Outcome.REFUSED
    finally:
        listener.close()


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
@raw
def test_a_process_without_cap_net_raw_falls_back() -> None:
    """A real process whose bounding set lacks CAP_NET_RAW: the check still
    works (connect-based) and the log names the missing privilege."""
    script = textwrap.dedent(
        """
        import asyncio, logging, socket, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        from healthgate.probes.batch import BatchProber
        from healthgate.probes.prober import ProbeSettings
        from healthgate.probes.spec import ProbeSpec
        listener = socket.socket(); listener.bind(("127.0.0.1", 0)); listener.listen(4)
        async def go():
            batch = BatchProber(ProbeSettings(tcp_half_open=True))
            loop = asyncio.get_running_loop()
            spec = ProbeSpec("TCP", "127.0.0.1", listener.getsockname()[1], 1.0, 1.0)
            result = batch.start("k", spec, loop.time())
            for _ in range(500):
                if result is not None:
                    break
                await asyncio.sleep(0.002)
                result = dict(batch.poll(loop.time())).get("k")
            print("outcome", result.outcome.name, "raw", batch._syn is not None)
        asyncio.run(go())
        """
    )
    out = subprocess.run(
        [
            "setpriv",
            "--inh-caps=-net_raw",
            "--bounding-set=-net_raw",
            sys.executable,
            "-c",
            script,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "outcome OK raw False" in out.stdout
    assert "cannot open a raw socket (that needs root or CAP_NET_RAW)" in out.stdout
