"""What the kernel tells us of a peer, and the memfd rules: nothing about a peer is
believed that the kernel can tell us instead.

Owns nothing; pure functions over sockets and descriptors.
"""

from __future__ import annotations

import fcntl
import ipaddress
import mmap
import os
import socket
import stat
import struct
from typing import Any

from .control import ProtocolError

__all__ = ["peer_pid", "peer_uid", "peer_pidfd", "is_local_peer", "memfd_stride", "seal_memfd", "check_memfd"]

SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)   # Linux >= 6.5

_UCRED = struct.Struct("3i")   # struct ucred: pid, uid, gid


def _peercred(sock: socket.socket) -> tuple[int, int, int]:
    """SO_PEERCRED: the kernel's record of who connected (or who listened) at the
    other end of a Unix socket; never a peer's claim."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end of a connected Unix socket."""
    pid = _peercred(sock)[0]
    if pid <= 0:
        raise ProtocolError("the peer's pid is not visible (another pid namespace?)")
    return pid


def peer_uid(sock: socket.socket) -> int:
    return _peercred(sock)[1]


def _pidfd_pid(fd: int) -> int | None:
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            for line in f:
                if line.startswith("Pid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def peer_pidfd(sock: socket.socket, pid: int) -> int:
    """A pidfd of the peer process of ``sock`` (``pid`` from :func:`peer_pid`).

    SO_PEERPIDFD (Linux >= 6.5) gives the pidfd of the very process that connected,
    with no pid-reuse window; older kernels fall back to ``os.pidfd_open(pid)``, which
    names whatever process has that pid now: if the peer died between connect() and
    this call and the pid was reused (by a process of a user we may write to), the
    pidfd names that process. That window is microseconds on a live peer.
    Raises ProtocolError if the peer is already gone or names another pid.
    """
    try:
        fd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        fd = -1
    if fd >= 0:
        got = _pidfd_pid(fd)
        if got == pid:
            return fd
        os.close(fd)
        raise ProtocolError(f"the peer's pidfd names pid {got}, SO_PEERCRED said {pid}")
    try:
        return os.pidfd_open(pid)
    except OSError as e:
        raise ProtocolError(f"cannot open a pidfd for the peer (pid {pid}): {e}") from None


def is_local_peer(peer: Any, local: Any) -> bool:   # Any: socket addresses, as typeshed's
    """True if a TCP peer is on this host: its address is 127.0.0.1 or ::1 (also as
    ::ffff:127.0.0.1), or equals the local address of the connection (a host connecting
    to one of its own addresses). Other loopback addresses (127.0.0.2, ...) do not count:
    tests use them to play a remote peer."""
    try:
        p = ipaddress.ip_address(peer[0].split("%")[0])
        l = ipaddress.ip_address(local[0].split("%")[0])
    except (TypeError, ValueError, IndexError, AttributeError):
        return False
    if isinstance(p, ipaddress.IPv6Address) and p.ipv4_mapped is not None:
        p = p.ipv4_mapped
    if isinstance(l, ipaddress.IPv6Address) and l.ipv4_mapped is not None:
        l = l.ipv4_mapped
    return p in (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")) or p == l


# ---------------------------------------------------------------- memfd checks

def memfd_stride(tensor_bytes: int) -> int:
    """Where tensor i starts in a cache's memfd (i * stride): its size rounded up to a
    page. Fixed by the descriptor, so a receiver maps exactly what the descriptor needs."""
    return -(-tensor_bytes // mmap.PAGESIZE) * mmap.PAGESIZE


def seal_memfd(fd: int) -> None:
    """Fix a memfd's size for good: no shrink (a peer's mapping would SIGBUS), no grow,
    no further seals (a peer could otherwise forbid writable mappings)."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)


def check_memfd(fd: int, length: int) -> None:
    """A peer's memfd is safe to map ``length`` bytes of: a regular file of exactly
    ``length`` bytes, every page allocated (not sparse: mapping it cannot make us
    allocate the peer's memory), sealed against shrinking and growing."""
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        raise ProtocolError(f"the announced fd is not a sealable memfd: {e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ProtocolError("the announced fd is not a memfd")
    need = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    if seals & need != need:
        raise ProtocolError("the announced memfd is not sealed against shrinking and growing")
    if st.st_size != length:
        raise ProtocolError(f"the announced memfd has {st.st_size} bytes, not {length}")
    if st.st_blocks * 512 < length:
        raise ProtocolError(f"the announced memfd is sparse ({st.st_blocks * 512} of {length} bytes allocated)")


