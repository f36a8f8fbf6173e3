"""The floor: what a bare Python loop on uvloop costs per health check.

    python bench/probe_floor.py                          # TCP and kept alive, 1,000 and 10,000
    python bench/probe_floor.py --counts 1000 --ticks 10,16,20
    python bench/probe_floor.py --checks syn             # half-open raw SYNs (root)

No scheduler, no result, no engine: every tick sends the due share of N
endpoints a TCP connect (``tcp``: half-open, ``full``: the handshake
completed, then a disconnect - exactly the system calls of healthgate's
batch prober), a raw SYN (``syn``: healthgate's own
prebuilt packets and raw socket, probes/syn.py) or a kept-alive HTTP
request, and reads the answers without blocking. What it costs per check is the least
any Python prober with this design can cost on this machine - the yardstick
for how much of healthgate's CPU per check is its own bookkeeping
(docs/benchmarks.md). One backend process (bench/backends.py) on core 1,
this loop on core 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import select
import socket
import struct
import sys
import tempfile
from pathlib import Path

import uvloop

from healthgate.probes.syn import SynSocket
from healthgate.process.limits import raise_open_file_limit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import backend_endpoints

REQUEST = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: floor\r\nAccept: */*\r\n\r\n"
_connect = ctypes.CDLL(None).connect
_UNSPEC = ctypes.create_string_buffer(struct.pack("=HH12x", socket.AF_UNSPEC, 0), 16)
_MASK = select.EPOLLIN | select.EPOLLOUT | select.EPOLLRDHUP | select.EPOLLET


async def run(
    count: int, base: int, check: str, tick: float, warmup: float, duration: float
) -> float:
    """CPU µs per check of the bare loop."""
    loop = asyncio.get_running_loop()
    ep = select.epoll()
    addrs = [("127.0.0.1", base + i) for i in range(count)]
    per_tick = max(1, round(count * tick))
    done = 0
    i = 0
    if check in ("tcp", "full"):
        quick = int(check == "full")  # full: the handshake completes (SPEC §2.1's default)
        pool: list[socket.socket] = []
        connecting: dict[int, socket.socket] = {}

        def start(n: int) -> None:
            nonlocal i, done
            for _ in range(n):
                if pool:
                    s = pool.pop()
                else:
                    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    ep.register(s.fileno(), _MASK)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, quick)
                if s.connect_ex(addrs[i % count]) == 0:
                    _connect(s.fileno(), _UNSPEC, 16)
                    pool.append(s)
                    done += 1
                else:
                    connecting[s.fileno()] = s
                i += 1

        def read() -> None:
            nonlocal done
            for fd, _ in ep.poll(0, 64):
                s = connecting.pop(fd, None)
                if s is not None:
                    _connect(fd, _UNSPEC, 16)
                    pool.append(s)
                    done += 1

    elif check == "syn":  # half-open as raw SYNs: healthgate's own packets and socket
        syn = SynSocket.open()
        if syn is None:
            raise SystemExit("syn: this process may not open a raw socket (root or CAP_NET_RAW)")
        packets = [syn.packet(ip, port) for ip, port in addrs]

        def start(n: int) -> None:
            nonlocal i
            for _ in range(n):
                syn.send(packets[i % count], addrs[i % count][0])
                i += 1

        def read() -> None:
            nonlocal done
            while True:
                answers, more = syn.answers()
                done += sum(1 for a in answers if a[3])
                if not more:
                    return

    else:
        socks = []
        for addr in addrs:
            s = socket.create_connection(addr)
            s.setblocking(False)
            ep.register(s.fileno(), select.EPOLLIN | select.EPOLLET)
            socks.append(s)
        by_fd = {s.fileno(): s for s in socks}

        def start(n: int) -> None:
            nonlocal i
            for _ in range(n):
                # (the backend drops a few at 10,000: its open-file limit)
                with contextlib.suppress(OSError):
                    socks[i % count].send(REQUEST)
                i += 1

        def read() -> None:
            nonlocal done
            for fd, _ in ep.poll(0, 64):
                if by_fd[fd].recv(65536).startswith(b"HTTP/1.1 200"):
                    done += 1

    def tick_once() -> None:
        loop.call_later(tick, tick_once)
        start(per_tick)
        read()

    loop.call_soon(tick_once)
    await asyncio.sleep(warmup)
    t0, d0 = os.times(), done
    await asyncio.sleep(duration)
    t1, d1 = os.times(), done
    cpu = (t1.user - t0.user) + (t1.system - t0.system)
    return cpu / max(d1 - d0, 1) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--counts", default="1000,10000")
    ap.add_argument("--checks", default="tcp,keepalive")
    ap.add_argument(
        "--ticks", default="", help="tick lengths in ms (default: 16 at 1,000, 2 at 10,000)"
    )
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--base-port", type=int, default=21000)
    args = ap.parse_args()
    raise_open_file_limit()  # (for the checkers started from here, and their sockets)
    os.sched_setaffinity(0, {0})
    print("endpoints check      tick  us/check")
    with tempfile.TemporaryDirectory() as tmp:
        for count in (int(c) for c in args.counts.split(",")):
            with backend_endpoints(count, args.base_port, Path(tmp)):
                ticks = (
                    [float(t) for t in args.ticks.split(",")]
                    if args.ticks
                    else [16.0 if count <= 1000 else 2.0]
                )
                for check in args.checks.split(","):
                    for tick_ms in ticks:
                        us = uvloop.run(
                            run(
                                count,
                                args.base_port,
                                check,
                                tick_ms / 1000,
                                args.warmup,
                                args.duration,
                            )
                        )
                        print(f"{count:9,} {check:10s} {tick_ms:4g} ms {us:8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
