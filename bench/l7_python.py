"""The Python cost of one plain request on the L7 fast path, in-process.

    python bench/l7_python.py            # the C speedups, then the pure-Python path

No sockets: an HttpProxy and a pooled UpstreamConnection over stand-in
transports, fed a wrk-like GET and an nginx-like response, N times. What it
measures is what the interpreter (and the C readers) spend per request,
without the kernel and the event loop - the part of bench/dataplane.py's
CPU per request that this code decides, steady enough to compare changes
one by one (bench/dataplane.py's ratios move by several points between
runs). Each mode runs in its own process (HEALTHGATE_PURE_PYTHON=1 for the
pure-Python path), on core 1 when taskset is there; the best of 7 rounds.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pinned

REQUEST = b"GET / HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n\r\n"
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Wed, 02 Dec 2026 09:01:00 GMT\r\n"
    b"Content-Type: application/octet-stream\r\nContent-Length: 2\r\nConnection: keep-alive\r\n"
    b"\r\nok"
)


class _Transport:
    """What the proxy calls on a transport, doing nothing but count writes."""

    def __init__(self) -> None:
        self.writes = 0
        self.closing = False

    def write(self, data: bytes) -> None:
        self.writes += 1

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def close(self) -> None:
        self.closing = True

    abort = close

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _measure(n: int, rounds: int) -> float:
    from healthgate.dataplane.counters import ListenerCounters
    from healthgate.dataplane.guard import ConnectionGuard
    from healthgate.dataplane.http import HttpProxy
    from healthgate.dataplane.http_limits import HttpSettings
    from healthgate.dataplane.upstream import UpstreamConnection, UpstreamPool

    settings = HttpSettings()
    pool = UpstreamPool(settings)
    address = ("127.0.0.1", 8080)
    upstream = UpstreamConnection(address)
    upstream.connection_made(_Transport())  # type: ignore[arg-type]
    pool.release(upstream)
    region = [address]
    turns: dict[str, int] = {}

    def first_try(path: str, consumer: bool) -> tuple[tuple[str, int], list[tuple[str, int]]]:
        # (the shape of ChoiceEngine.first_try's round robin: a dict read and a modulo)
        turn = turns.get(path, 0)
        turns[path] = turn + 1
        return region[turn % len(region)], region

    guard = ConnectionGuard(1000)
    counters = ListenerCounters()
    stats = counters.events
    proxy = HttpProxy(
        lambda: [region],
        pool,
        settings,
        counters,
        None,
        None,
        functools.partial(first_try, "fr", True),
        guard,
    )
    client = _Transport()
    proxy.connection_made(client)  # type: ignore[arg-type]
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            proxy.data_received(REQUEST)
            upstream.data_received(RESPONSE)
        best = min(best, (time.perf_counter() - start) / n)
    assert stats["fast_path"] == n * rounds and client.writes == n * rounds, stats
    pool.close()
    guard.close()
    return best * 1e9


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=200_000, help="per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--one", choices=["c", "python"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # a child: one mode
        import uvloop

        from healthgate import http_scan

        assert http_scan.COMPILED is (args.one == "c"), "the C speedups are not built here"
        print(f"{uvloop.run(_measure(args.requests, args.rounds)):.0f}")
        return 0
    results = {}
    for mode in ("c", "python"):
        env = {**os.environ, "HEALTHGATE_PURE_PYTHON": "1" if mode == "python" else "0"}
        out = subprocess.run(
            pinned(
                [
                    sys.executable,
                    __file__,
                    "--one",
                    mode,
                    "--requests",
                    str(args.requests),
                    "--rounds",
                    str(args.rounds),
                ],
                1,
            ),
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if out.returncode != 0:
            print(f"{mode}: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            continue
        results[mode] = float(out.stdout)
    for mode, ns in results.items():
        label = "C speedups" if mode == "c" else "pure Python (HEALTHGATE_PURE_PYTHON=1)"
        print(f"{label:<40} {ns:>7.0f} ns of Python per plain request (best of {args.rounds})")
    if len(results) == 2:
        print(f"C / pure Python: {results['c'] / results['python']:.2f}x")
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
