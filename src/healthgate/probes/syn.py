"""Half-open TCP checks on one raw socket: a SYN out, the answer in.

``serve --tcp-half-open`` checks a TCP endpoint the way HAProxy does - the
server's kernel answers the SYN, the connection never reaches its accept
queue - but HAProxy still pays a socket, a connect, an epoll registration
and a close for every check. Where this process may open a raw socket (root,
or ``CAP_NET_RAW``) it pays none of them:

* **One raw socket** (``AF_INET``, ``SOCK_RAW``, ``IPPROTO_TCP``) sends every
  SYN; the kernel adds the IP header. The SYN is **built once per endpoint**
  (a 24-byte TCP header with an MSS option, its checksum summed over the
  pseudo-header once): a probe writes its sequence number and the checksum's
  update into it and sends it (one ``sendto``).
* **A few source ports** (:data:`SOURCE_PORTS`), each held by a bound,
  unconnected TCP socket: no other socket of this machine gets them, and
  since no socket is *connected* on them, the kernel answers each SYN+ACK
  with a reset itself - the server's half-open connection is gone at once,
  as with HAProxy's check. Each probe leaves from one of them, drawn at
  random.
* **A kernel packet filter** (classic BPF on the raw socket) lets through
  only TCP packets to those ports, so Python reads the answers to its own
  probes and nothing else of the machine's traffic.
* **Answers are matched by sequence number**: every probe sends a sequence
  number of its own, drawn from the kernel's random source (``os.urandom``,
  in batches) - not one more than the last, which let anyone who saw one
  probe forge the answer (a reset: "refused") to the next - and a SYN+ACK
  or a reset that answers it acknowledges that number + 1, from the
  endpoint's address and port to the probe's own port. SYN+ACK: up; reset:
  refused; nothing by the deadline: timeout (one SYN, no retransmission - a
  lost packet is a failed check, which the thresholds are there to absorb;
  ICMP errors are not read, so an unreachable host is a timeout too). The
  ports are never logged.

IPv4 only: IPv6 endpoints, and every endpoint when the raw socket cannot be
opened, take the connect-based half-open check (:mod:`healthgate.probes.batch`,
which says so in the log once).
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import struct
from collections.abc import Container
from typing import Final

log = logging.getLogger("healthgate.probes")

_SO_ATTACH_FILTER: Final = getattr(socket, "SO_ATTACH_FILTER", 26)
_SYN: Final = 0x02
_RST: Final = 0x04
_ACK: Final = 0x10
_HEADER: Final = struct.Struct("!HHIIBBHHH")  # ports, seq, ack, offset, flags, window, sum, urg
_MSS: Final = b"\x02\x04\x05\xb4"  # MSS 1460, as a kernel's SYN would carry
_LEN: Final = _HEADER.size + len(_MSS)  # 24
_ANSWER: Final = struct.Struct("!HHII")  # source port, destination port, seq, ack
_pack_seq: Final = struct.Struct("!I").pack_into
_pack_sum: Final = struct.Struct("!H").pack_into
_pack_port: Final = _pack_sum
SYN_READ: Final = 256  # answers read per call at most (poll checks its time budget between reads)


SOURCE_PORTS: Final = 16  # ports a probe's SYN may leave from (one drawn per probe)
_RANDOM_BATCH: Final = 4096  # sequence numbers drawn from the kernel at once


def _filter(ports: list[int]) -> bytes:
    """Classic BPF: accept a TCP segment (the raw socket hands whole IPv4
    packets) whose destination port is one of ``ports``, drop everything else."""
    ins = struct.Struct("=HBBI")
    k = len(ports)
    program = [
        ins.pack(0xB1, 0, 0, 0),  # ldxb 4*([0]&0xf)   X = IP header length
        ins.pack(0x48, 0, 0, 2),  # ldh [x+2]          A = TCP destination port
    ]
    for i, port in enumerate(ports):  # jeq #port, to accept, else the next test
        program.append(ins.pack(0x15, k - i, 0, port))
    program.append(ins.pack(0x06, 0, 0, 0))  # ret #0     drop
    program.append(ins.pack(0x06, 0, 0, 96))  # ret #96   accept (headers are enough)
    return b"".join(program)


def _words(data: bytes) -> int:
    return sum(struct.unpack(f"!{len(data) // 2}H", data))


class SynPacket:
    """The SYN for one endpoint, built once: :meth:`stamp` sets a source
    port and a sequence number, and the checksum's matching update."""

    __slots__ = ("buf", "partial")

    def __init__(self, src: str, dst: str, dport: int) -> None:
        header = _HEADER.pack(0, dport, 0, 0, (_LEN // 4) << 4, _SYN, 65535, 0, 0) + _MSS
        pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!HH", 6, _LEN)
        # everything but the source port and the sequence number
        self.partial = _words(pseudo) + _words(header)
        self.buf = bytearray(header)

    def stamp(self, seq: int, sport: int) -> bytearray:
        total = self.partial + sport + (seq >> 16) + (seq & 0xFFFF)
        total = (total & 0xFFFF) + (total >> 16)
        total = (total & 0xFFFF) + (total >> 16)
        buf = self.buf
        _pack_port(buf, 0, sport)
        _pack_seq(buf, 4, seq)
        _pack_sum(buf, 16, ~total & 0xFFFF)
        return buf


class SynSocket:
    """The raw socket, the held port and the filter; :meth:`open` returns
    None (and says why) where raw sockets are not allowed."""

    def __init__(
        self, raw: socket.socket, holders: list[socket.socket], source: str | None
    ) -> None:
        self.raw = raw
        self.holders = holders
        self.ports: list[int] = [h.getsockname()[1] for h in holders]
        self._port_set = frozenset(self.ports)
        self.source = source
        self._sources: dict[str, str] = {}  # destination -> the source address the route gives
        self._random = memoryview(b"")  # sequence numbers to come (os.urandom, in batches)
        self._buf = bytearray(128)

    @classmethod
    def open(cls, source: str | None = None) -> SynSocket | None:
        try:
            raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
        except PermissionError:
            return None  # (the caller says so)
        except OSError as exc:
            log.warning("no raw socket (%s)", exc.strerror)
            return None
        holders: list[socket.socket] = []
        try:
            for _ in range(SOURCE_PORTS):
                holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                holders.append(holder)
                holder.bind((source or "0.0.0.0", 0))
            if source is not None:
                raw.bind((source, 0))
            program = _filter([h.getsockname()[1] for h in holders])
            code = ctypes.create_string_buffer(program, len(program))
            fprog = struct.pack("@HP", len(program) // 8, ctypes.addressof(code))
            raw.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            raw.setblocking(False)
        except OSError:
            raw.close()
            for holder in holders:
                holder.close()
            raise
        syn = cls(raw, holders, source)
        syn.drain()  # what arrived before the filter was attached
        return syn

    def _draw(self) -> tuple[int, int]:
        """A sequence number and a source port, from the kernel's random source."""
        left = self._random
        if len(left) < 6:
            left = memoryview(os.urandom(6 * _RANDOM_BATCH))
        seq = int.from_bytes(left[:4], "big")
        port = self.ports[left[4] % len(self.ports)]
        self._random = left[6:]
        return seq, port

    def source_for(self, dst: str) -> str:
        """The source address of a packet to ``dst``: ``--probe-source``, or
        the route's (a UDP socket's connect chooses it and sends nothing)."""
        if self.source is not None:
            return self.source
        src = self._sources.get(dst)
        if src is None:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                udp.connect((dst, 9))
                src = self._sources[dst] = str(udp.getsockname()[0])
        return src

    def packet(self, dst: str, dport: int) -> SynPacket:
        return SynPacket(self.source_for(dst), dst, dport)

    def send(self, packet: SynPacket, dst: str, taken: Container[int] = ()) -> tuple[int, int]:
        """Send ``packet`` with a fresh random sequence number (none of
        ``taken``: the numbers in flight) from a random one of the ports;
        returns (the number, the port) - an OSError propagates: the caller
        turns it into a result."""
        seq, port = self._draw()
        while seq in taken:
            seq, port = self._draw()
        self.raw.sendto(packet.stamp(seq, port), (dst, 0))
        return seq, port

    def answers(self) -> tuple[list[tuple[int, str, int, int, bool]], bool]:
        """The answers waiting, from at most ``SYN_READ`` packets: (the
        sequence number they acknowledge, source address, source port, the
        port they came to, SYN+ACK or reset); and whether packets may still
        be waiting."""
        out: list[tuple[int, str, int, int, bool]] = []
        raw, buf, ports = self.raw, self._buf, self._port_set
        unpack = _ANSWER.unpack_from
        for _ in range(SYN_READ):
            try:
                n = raw.recv_into(buf)
            except (BlockingIOError, InterruptedError):
                return out, False
            ihl = (buf[0] & 0x0F) * 4
            if n < ihl + 20:
                continue
            sport, dport, _seq, ack = unpack(buf, ihl)
            flags = buf[ihl + 13]
            if dport not in ports or not flags & _ACK:
                continue
            if flags & _RST:
                up = False
            elif flags & _SYN:
                up = True
            else:
                continue
            src = socket.inet_ntoa(bytes(buf[12:16]))
            out.append(((ack - 1) & 0xFFFFFFFF, src, sport, dport, up))
        return out, True

    def drain(self) -> None:
        while True:
            try:
                self.raw.recv_into(self._buf)
            except (BlockingIOError, InterruptedError):
                return

    def close(self) -> None:
        self.raw.close()
        for holder in self.holders:
            holder.close()


def can_open_raw() -> bool:
    """Whether this process may open a raw socket (for tests and the log)."""
    try:
        socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP).close()
    except OSError:
        return False
    return True
