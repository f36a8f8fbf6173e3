"""The batch prober alone: CPU per TCP check, user and kernel, without serve.

    python bench/prober_alone.py                  # 1,000 endpoints, 20 rounds
    python bench/prober_alone.py --check http [--keepalive]
    HEALTHGATE_PURE_PYTHON=1 python bench/prober_alone.py ...   # without the C reader

bench/probes.py measures the whole `healthgate serve` process per check; this
measures only what `BatchProber` (probes/batch.py) spends: every endpoint of
bench/backends.py (core 1) checked once per round from this process (core
0), back to back, with no scheduler, engine or event loop around it. User
time is the interpreter's share (and libc's); kernel time is the handshake
and the reset - which, on loopback, includes the server side's TCP work
done in the sender's system call. What serve spends per check beyond this
is the scheduler's, the engine's and the event loop's.
"""

from __future__ import annotations

import argparse
import os
import resource
import select
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import backend_endpoints
from healthgate.probes.batch import BatchProber
from healthgate.probes.prober import ProbeSettings
from healthgate.probes.spec import ProbeSpec


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--check", choices=["tcp", "http"], default="tcp")
    ap.add_argument("--keepalive", action="store_true", help="HTTP: keep connections alive")
    ap.add_argument("--contains", action="store_true", help="HTTP: responseContains 'ok'")
    ap.add_argument("--base-port", type=int, default=23000)
    args = ap.parse_args()
    with (
        tempfile.TemporaryDirectory() as tmp,
        backend_endpoints(args.count, args.base_port, Path(tmp)),
    ):
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {0})
        specs = [
            ProbeSpec(
                args.check.upper(),
                "127.0.0.1",
                args.base_port + i,
                2.0,
                1.0,
                contains=b"ok" if args.contains else b"",
            )
            for i in range(args.count)
        ]
        prober = BatchProber(ProbeSettings(keepalive=args.keepalive))

        def one_round() -> None:
            now = time.monotonic()
            done = sum(prober.start(i, spec, now) is not None for i, spec in enumerate(specs))
            deadline = time.monotonic() + 10
            while done < len(specs) and time.monotonic() < deadline:  # bounded
                select.select([], [], [], 0.002)
                done += len(prober.poll(time.monotonic()))
            assert done == len(specs), f"{done} of {len(specs)} checks finished"

        for _ in range(3):  # warm-up: the socket pool fills
            one_round()
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        for _ in range(args.rounds):
            one_round()
        after = resource.getrusage(resource.RUSAGE_SELF)
        wall = time.perf_counter() - start
        prober.close()
    n = args.count * args.rounds
    user = (after.ru_utime - before.ru_utime) / n * 1e6
    kernel = (after.ru_stime - before.ru_stime) / n * 1e6
    print(
        f"{args.check}{' kept alive' if args.keepalive else ''}"
        f"{' contains' if args.contains else ''} checks: {n:,} in {wall:.2f} s; per check: user {user:.1f} us, "
        f"kernel {kernel:.1f} us, total {user + kernel:.1f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
