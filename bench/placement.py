"""What a membership change costs a cluster node (issue 39, docs/cluster.md).

    python bench/placement.py                    # 100,000 endpoints, 4 nodes
    python bench/placement.py --endpoints 20000

A node's probe source (ClusterProbing, no etcd: only the placement and its
prober engine) over bench/cluster.py's world; timed, in one process and one
run: the whole placement (a node's first), then one node leaving, then the
same node joining again - what every other node does each time a lease
ends or a node starts. Only the endpoints the change moves should cost:
the leaver's, the ones the joiner wins. Printed: seconds of this process's
CPU for each, and the change's cost against the whole placement's.

Why it matters: a node's event loop is blocked for that long, and a loop
blocked past the lease TTL (5 s) loses the node's session, which moves
the members again.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import world
from healthgate.cluster.probing import ClusterProbing, ClusterSettings
from healthgate.controlplane.health_service import HealthService
from healthgate.controlplane.probing import Feed
from healthgate.model.resources import Resource
from healthgate.model.validation import parse_resource
from healthgate.probes.stats import FailureLogLimiter


def resources(count: int) -> list[Resource]:
    out = []
    for batch in world(count, 9999):
        for doc in batch:
            res, issues = parse_resource(doc)
            if res is None:
                raise SystemExit(f"the bench's world is refused: {issues}")
            out.append(res)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoints", type=int, default=100_000)
    ap.add_argument("--nodes", type=int, default=4)
    args = ap.parse_args()
    made: list[ClusterProbing] = []

    def source(feed: Feed, failure_log: FailureLogLimiter) -> ClusterProbing:
        made.append(ClusterProbing(feed, ClusterSettings("n0", "r1")))
        return made[0]

    service = HealthService(source=source)
    probing = made[0]
    service.apply(resources(args.endpoints))
    everyone = {f"n{i}": "r1" for i in range(args.nodes)}
    one_less = {n: r for n, r in everyone.items() if n != f"n{args.nodes - 1}"}

    def timed(members: dict[str, str]) -> float:
        started = time.process_time()
        probing.set_members(members)
        return time.process_time() - started

    whole = timed(everyone)
    mine = len(probing.mine)
    left = timed(one_less)
    back = timed(everyone)
    print(
        f"{args.endpoints:,} endpoints, {args.nodes} nodes (this node probes {mine:,}); "
        f"CPU seconds:\n"
        f"  the whole placement          {whole:6.2f}\n"
        f"  a node leaving               {left:6.2f}  ({left / whole:.2f}x the whole)\n"
        f"  the same node joining again  {back:6.2f}  ({back / whole:.2f}x the whole)"
    )


if __name__ == "__main__":
    main()
