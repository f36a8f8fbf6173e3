"""Networks on one machine: one Linux network namespace per place, a bridge
between them, links cut and healed with nftables.

``Lab`` (a context manager) creates

* a *hub* namespace holding a bridge, with no address of its own;
* for each place (``lab.place("us-node", "198.18.0.10")``) a namespace with
  one veth into the bridge carrying the place's addresses (198.18.0.0/24:
  the range RFC 2544 sets aside for benchmarks, routed nowhere), loopback
  up, and an nftables table ``inet hgcut`` whose set ``cut`` holds the
  addresses this place cannot reach (packets to and from them are dropped,
  silently: a cut is a network that stops answering, not one that refuses);
* an *observer* veth in this process's namespace (198.18.0.1), so that the
  test or bench reads every node's API while the places are cut from each
  other; it is never cut.

Nothing is routed out of the machine: the namespaces have no default route
and no NAT; the observer's route covers 198.18.0.0/24 only.

``cut(a, b)`` drops everything between the places of ``a`` and those of
``b`` (both ways); ``cut_one_way`` only what ``a`` sends to ``b``;
``heal()`` undoes every cut. ``spawn(place, argv)`` runs a process inside
a place; ``close()`` kills every process spawned and deletes every
namespace and link, also when a test failed - and a lab left behind by a
killed run (its pid in the names is gone) is removed by the next one.

No netem here: these kernels have no ``sch_netem``, so latency cannot be
added - a link is either up or cut. Needs root (``CAP_NET_ADMIN``), ``ip``
and ``nft``; :func:`unavailable` says why not, in one line.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "198.18.0"
OBSERVER = f"{SUBNET}.1"
PREFIX = "hgp"  # namespaces: hgp<pid>-<place>


def unavailable() -> str | None:
    """Why a lab cannot be built here (None: it can)."""
    if os.geteuid() != 0:
        return "the partition tests need root (network namespaces and nftables)"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"the partition tests need {tool}: apt-get install {package}"
    return None


def _run(*argv: str, ns: str | None = None, check: bool = True, stdin: str | None = None) -> str:
    cmd = ["ip", "netns", "exec", ns, *argv] if ns else list(argv)
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=20, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Delete the namespaces (and the observer link) of labs whose process is gone."""
    removed = []
    for ns in _namespaces():
        if not ns.startswith(PREFIX):
            continue
        pid = ns[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _run("ip", "netns", "delete", ns, check=False)
            removed.append(ns)
    for line in _run("ip", "-o", "link", "show").splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(PREFIX) and name.endswith("o"):
            pid = name[len(PREFIX) : -1]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                _run("ip", "link", "delete", name, check=False)
                removed.append(name)
    return removed


NFT_TABLE = """
table inet hgcut {
    set cut { type ipv4_addr; }
    set mute { type ipv4_addr; }
    chain input { type filter hook input priority 0; policy accept; ip saddr @cut drop; }
    chain output {
        type filter hook output priority 0; policy accept;
        ip daddr @cut drop; ip daddr @mute drop;
    }
}
"""


@dataclass(slots=True)
class Place:
    name: str
    ns: str
    addresses: tuple[str, ...]
    cut: set[str] = field(default_factory=set)  # addresses it cannot reach now
    mute: set[str] = field(default_factory=set)  # addresses it cannot send to (one way)

    @property
    def address(self) -> str:
        return self.addresses[0]


class Lab:
    def __init__(self) -> None:
        why = unavailable()
        if why:
            raise RuntimeError(why)
        remove_stale()
        self.id = f"{PREFIX}{os.getpid()}"
        self.hub = f"{self.id}-hub"
        self.places: dict[str, Place] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        self._observer = f"{self.id}o"
        self._ports = 0
        self._closed = False
        try:
            _run("ip", "netns", "add", self.hub)
            _run("ip", "link", "add", "br0", "type", "bridge", ns=self.hub)
            _run("ip", "link", "set", "br0", "up", ns=self.hub)
            _run("ip", "link", "set", "lo", "up", ns=self.hub)
            # the observer: this process's window into the lab
            self._plug(None, self._observer, (OBSERVER,))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _plug(self, ns: str | None, name: str, addresses: Sequence[str]) -> None:
        """A veth from ``ns`` (None: this process's namespace) into the bridge."""
        self._ports += 1
        peer = f"p{self._ports}"
        where = ("-n", ns) if ns else ()
        _run("ip", *where, "link", "add", name, "type", "veth", "peer", "name", peer,
             "netns", self.hub)  # fmt: skip
        _run("ip", "link", "set", peer, "master", "br0", "up", ns=self.hub)
        for address in addresses:
            _run("ip", *where, "addr", "add", f"{address}/24", "dev", name)
        _run("ip", *where, "link", "set", name, "up")

    def place(self, name: str, *addresses: str) -> Place:
        """A namespace with these addresses, on the bridge, with its cut table."""
        ns = f"{self.id}-{name}"
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "set", "lo", "up", ns=ns)
        self._plug(ns, "eth0", addresses)
        _run("nft", "-f", "-", ns=ns, stdin=NFT_TABLE)
        place = Place(name, ns, tuple(addresses))
        self.places[name] = place
        return place

    # ------------------------------------------------------------------ cuts

    def _set(self, place: Place, which: str, addresses: set[str]) -> None:
        _run("nft", "flush", "set", "inet", "hgcut", which, ns=place.ns)
        if addresses:
            elements = ", ".join(sorted(addresses))
            _run("nft", "add", "element", "inet", "hgcut", which, f"{{ {elements} }}", ns=place.ns)

    def cut(self, a: Iterable[str], b: Iterable[str]) -> None:
        """Nothing passes between the places named in ``a`` and those in ``b``."""
        pa, pb = [self.places[n] for n in a], [self.places[n] for n in b]
        for x, others in ((pa, pb), (pb, pa)):
            for place in x:
                place.cut.update(addr for o in others for addr in o.addresses)
                self._set(place, "cut", place.cut)

    def isolate(self, names: Iterable[str]) -> None:
        """Cut the places in ``names`` from every other place (not the observer)."""
        inside = set(names)
        self.cut(inside, [n for n in self.places if n not in inside])

    def cut_one_way(self, a: Iterable[str], b: Iterable[str]) -> None:
        """What the places in ``a`` send to those in ``b`` is dropped (the
        other way still passes - so TCP between them fails both ways, but
        UDP and a listener's view differ)."""
        for name in a:
            place = self.places[name]
            place.mute.update(addr for n in b for addr in self.places[n].addresses)
            self._set(place, "mute", place.mute)

    def heal(self) -> None:
        for place in self.places.values():
            if place.cut or place.mute:
                place.cut.clear()
                place.mute.clear()
                self._set(place, "cut", set())
                self._set(place, "mute", set())

    # ------------------------------------------------------------------ processes

    def spawn(
        self, place: str, argv: Sequence[str], log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """``argv`` inside ``place`` (``ip netns exec`` execs it: the pid is its own)."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.places[place].ns, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.kill()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        for place in self.places.values():
            _run("ip", "netns", "delete", place.ns, check=False)
        _run("ip", "link", "delete", self._observer, check=False)
        _run("ip", "netns", "delete", self.hub, check=False)
