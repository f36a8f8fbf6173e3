"""The UDP listener's own socket, made here rather than by asyncio.

* **IPv6 only**: a UDP socket bound to an IPv6 address takes IPv6 alone
  (``IPV6_V6ONLY``, as asyncio already makes TCP listeners), so ``::``
  means every IPv6 address and never every IPv4 one too - what the rule
  "no two forwarding rules on one address and port" assumes
  (model/rules.py).
* **A wildcard answers from the address it was asked at**: a socket bound
  to ``0.0.0.0`` (or ``::``) used to answer from whatever address the
  kernel's routing chose (127.0.0.1 for a loopback client, whatever it had
  asked), so a client that checks where an answer comes from - most do -
  dropped it. :class:`PktInfoEndpoint` reads each datagram with its
  destination address (``IP_PKTINFO`` / ``IPV6_RECVPKTINFO``) and answers
  each client from that address (``sendmsg`` with the same control
  message). asyncio's datagram transport has neither, so this is a small
  transport of its own over the event loop's reader: a bounded number of
  datagrams a wake-up, and as many clients' addresses remembered as the
  listener has sessions (at most ``max_clients``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from collections import OrderedDict
from typing import Any

# Linux's values (socket.py has no IP_PKTINFO)
IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)
IPV6_RECVPKTINFO = getattr(socket, "IPV6_RECVPKTINFO", 49)
IPV6_PKTINFO = getattr(socket, "IPV6_PKTINFO", 50)
READS_PER_WAKEUP = 64
CMSG_SPACE = socket.CMSG_SPACE(64)


def is_wildcard(ip: str) -> bool:
    return ip in ("0.0.0.0", "::")


def udp_socket(ip: str, port: int, reuse_port: bool) -> socket.socket:
    """A bound, non-blocking UDP socket (OSError as bind raises it)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if is_wildcard(ip):
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, IPV6_RECVPKTINFO, 1)
            else:
                sock.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
        sock.bind((ip, port))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class PktInfoEndpoint(asyncio.DatagramTransport):
    """A datagram transport over a wildcard socket that answers each client
    from the address the client sent to (see the module doc)."""

    def __init__(
        self,
        sock: socket.socket,
        protocol: asyncio.DatagramProtocol,
        max_clients: int = 65536,
    ) -> None:
        super().__init__()
        self._sock = sock
        self._protocol = protocol
        self._loop = asyncio.get_running_loop()
        self._v6 = sock.family == socket.AF_INET6
        self._max_clients = max_clients
        # client -> the control message that makes an answer leave from the
        # address that client sent to
        self._answer_from: OrderedDict[Any, bytes] = OrderedDict()
        self._closing = False
        self._loop.add_reader(sock.fileno(), self._readable)
        protocol.connection_made(self)

    def _readable(self) -> None:
        level = socket.IPPROTO_IPV6 if self._v6 else socket.IPPROTO_IP
        kind = IPV6_PKTINFO if self._v6 else IP_PKTINFO
        for _ in range(READS_PER_WAKEUP):
            try:
                data, ancillary, _, addr = self._sock.recvmsg(65535, CMSG_SPACE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._protocol.error_received(exc)
                return
            for cmsg_level, cmsg_type, cmsg_data in ancillary:
                if cmsg_level == level and cmsg_type == kind:
                    self._remember(addr[:2], self._answer_info(cmsg_data))
            self._protocol.datagram_received(data, addr[:2])
            if self._closing:
                return

    def _answer_info(self, received: bytes) -> bytes:
        """The control message to answer with: the destination of what was
        received as the source (``ipi_spec_dst``), no interface forced."""
        if self._v6:  # struct in6_pktinfo {in6_addr addr; unsigned ifindex}
            return received[:16] + bytes(4)
        # struct in_pktinfo {int ifindex; in_addr spec_dst; in_addr addr}
        return bytes(4) + received[8:12] + bytes(4)

    def _remember(self, client: Any, info: bytes) -> None:
        answer_from = self._answer_from
        if answer_from.get(client) == info:
            answer_from.move_to_end(client)
            return
        answer_from[client] = info
        answer_from.move_to_end(client)
        while len(answer_from) > self._max_clients:
            answer_from.popitem(last=False)

    def sendto(self, data: Any, addr: Any = None) -> None:
        if self._closing or addr is None:
            return
        info = self._answer_from.get(tuple(addr[:2]))
        ancillary = []
        if info is not None:
            level = socket.IPPROTO_IPV6 if self._v6 else socket.IPPROTO_IP
            ancillary.append((level, IPV6_PKTINFO if self._v6 else IP_PKTINFO, info))
        try:
            self._sock.sendmsg([data], ancillary, 0, addr)
        except (BlockingIOError, InterruptedError):
            pass  # (a full send buffer drops the datagram, as UDP may)
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH):
                self._protocol.error_received(exc)

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._answer_from.clear()
        self._loop.call_soon(self._protocol.connection_lost, None)

    def abort(self) -> None:
        self.close()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "socket":
            return self._sock
        if name == "sockname":
            return self._sock.getsockname()
        return default
