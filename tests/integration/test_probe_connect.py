"""The batch prober's connect and disconnect (probes/batch.py): addresses
packed once per endpoint, and the two system calls in C (_speedups.c's
connect_fd / disconnect_fd) - on real loopback sockets, IPv4 and IPv6,
against what the kernel says happened."""

from __future__ import annotations

import contextlib
import errno
import select
import socket

import pytest

from healthgate import http_scan
from healthgate.probes.batch import pack_sockaddr

speedups = http_scan.speedups
needs_c = pytest.mark.skipif(speedups is None, reason="the C speedups are not in use")
FAMILIES = [(socket.AF_INET, "127.0.0.1")] + ([(socket.AF_INET6, "::1")] if socket.has_ipv6 else [])


def test_packed_addresses() -> None:
    v4 = pack_sockaddr("127.0.0.1", 8080)
    assert v4 is not None and len(v4) == 16
    assert v4[2:4] == (8080).to_bytes(2, "big") and v4[4:8] == bytes([127, 0, 0, 1])
    v6 = pack_sockaddr("::1", 443)
    assert v6 is not None and len(v6) == 28
    assert v6[2:4] == (443).to_bytes(2, "big") and v6[8:24] == bytes(15) + b"\x01"
    assert pack_sockaddr("fe80::1%eth0", 80) is None  # (a scope: Python's connect_ex parses it)
    for bad in ("127.0.0.256", "not-an-ip", "1:2:3"):
        with pytest.raises(OSError):
            pack_sockaddr(bad, 80)


@needs_c
@pytest.mark.parametrize(("family", "ip"), FAMILIES)
def test_connect_and_disconnect_on_loopback(family: int, ip: str) -> None:
    assert speedups is not None
    with socket.socket(family) as server, socket.socket(family, socket.SOCK_STREAM) as client:
        server.bind((ip, 0))
        server.listen(4)
        port = server.getsockname()[1]
        client.setblocking(False)
        address = pack_sockaddr(ip, port)
        assert address is not None
        err = speedups.connect_fd(client.fileno(), address)
        assert err in (0, errno.EINPROGRESS)
        if err:  # (loopback usually completes inside the call)
            select.select([], [client], [], 5.0)
        assert client.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        assert client.getpeername()[1] == port  # the kernel says: connected there
        server.settimeout(5.0)
        accepted, _ = server.accept()
        with accepted:
            assert speedups.disconnect_fd(client.fileno()) == 0
            with pytest.raises(OSError):  # dissolved: no peer any more
                client.getpeername()
            # and the server sees the association end (reset, or end of stream)
            accepted.settimeout(5.0)
            with contextlib.suppress(ConnectionResetError):
                assert accepted.recv(1) == b""
        # the same socket connects again (the prober's pool reuses it)
        err = speedups.connect_fd(client.fileno(), address)
        assert err in (0, errno.EINPROGRESS)


@needs_c
def test_refused_and_bad_descriptors_come_back_as_errno() -> None:
    assert speedups is not None
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        closed = holder.getsockname()[1]  # bound, not listening: refuses
        with socket.socket() as client:
            client.setblocking(False)
            address = pack_sockaddr("127.0.0.1", closed)
            assert address is not None
            err = speedups.connect_fd(client.fileno(), address)
            if err == errno.EINPROGRESS:
                select.select([], [client], [], 5.0)
                err = client.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            assert err == errno.ECONNREFUSED
    assert speedups.connect_fd(10**6, pack_sockaddr("127.0.0.1", 1)) == errno.EBADF
    assert speedups.disconnect_fd(10**6) == errno.EBADF


@needs_c
def test_bad_arguments_are_refused_before_any_system_call() -> None:
    assert speedups is not None
    with pytest.raises(ValueError, match="packed sockaddr"):
        speedups.connect_fd(0, b"\x02\x00")
    with pytest.raises(TypeError):
        speedups.connect_fd(0, "127.0.0.1")
    with pytest.raises(ValueError, match="file descriptor"):
        speedups.disconnect_fd(-1)
    with pytest.raises(TypeError):
        speedups.connect_fd(0)
