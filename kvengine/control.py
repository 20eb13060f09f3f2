"""Link control plane: the wire format, limits, addresses and authentication helpers.

A link starts on TCP (the ``listen`` address users know): hello -> welcome ->
attach (the client's proof) -> attached. Nothing private (pid, Unix socket name,
data port, tokens) goes out before the peer has authenticated, and hello-phase
frames are at most HELLO_MAX bytes. When both engines are on one host the client
then joins the server's Unix SEQPACKET socket with a one-time token; that socket
carries file descriptors (sealed memfd caches are shared that way), tells each
side the other's pid from the kernel (SO_PEERCRED, never from a message), and its
EOF tells at once that the peer process died. Across hosts (or with
``transport="tcp"``) the TCP connection stays the control channel and the native
core opens the data connections (docs/protocol.md).

Messages are small JSON objects with a type field ``t``; nothing here moves
payload bytes. The channels that carry them: kvengine/channels.py; what the
kernel tells us of a peer (SO_PEERCRED, pidfds, memfd seals): kvengine/kernel.py.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
from typing import Any

PROTOCOL_VERSION = 3           # 2: pid from SO_PEERCRED, nothing before the proof, leases; 3: incarnations
MAX_FRAME = 4 << 20          # bytes of one control message once the peer is authenticated
HELLO_MAX = 4096             # bytes of one frame of the hello phase (hello, welcome, attach, attached, join)
MAX_FDS = 512                # descriptors one message may carry
HELLO_PHASE_MAX = 5.0        # seconds: the whole unauthenticated phase, at most (and at most link_timeout)
MAX_PREAUTH = 64             # unauthenticated control connections at once (TCP and Unix), beyond
MAX_PREAUTH_PER_SOURCE = 16  # ... which (or this many from one source address, or Unix uid) a newcomer
PREAUTH_GRACE = 0.5          # evicts the oldest if it waited this many seconds; if not (a burst of
MAX_PREAUTH_BURST = 256      # real peers), it waits too, up to this many; beyond, it is closed at once
MAX_REMOTE_CACHES = 65536    # caches one peer may have announced at once on a link
CLOSE_LINGER = 2.0           # seconds a closed TCP control connection may take to flush


# A control message: a decoded JSON object with a str type field ``t``. Its values are
# whatever JSON a peer sent (hence Any): every reader checks the fields it uses.
Message = dict[str, Any]


class ProtocolError(Exception):
    """The peer sent something that is not a valid control message."""


def host_identity() -> str:
    """Same string for every process that can share memfds and use CMA with us.

    Boot id (same kernel), plus the network namespace (abstract Unix sockets are
    per netns) and the pid namespace (pids in CMA calls are per pid ns).
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    parts = [boot]
    for ns in ("net", "pid"):
        try:
            parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
        except OSError:
            parts.append("?")
    return ":".join(parts)


def encode(msg: Message) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def decode(data: bytes) -> Message:
    try:
        msg = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:   # RecursionError: deep nesting
        raise ProtocolError(f"bad control message: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ProtocolError("control message without a type")
    return msg


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port); ValueError if malformed."""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"address must be 'host:port', got {address!r}")
    host, _, port_s = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port = int(port_s)
    if not host or not 0 <= port <= 65535:
        raise ValueError(f"address must be 'host:port', got {address!r}")
    return host, port


# --------------------------------------------------------------- authentication

def new_nonce() -> str:
    return secrets.token_hex(16)


_process: tuple[int, str] = (0, "")


def process_tag() -> str:
    """A random tag of this process (a new one after fork): a hello carries it so that the
    server can choose the in-process transport. A claim only: the server then requires the
    Unix peer's SO_PEERCRED pid to be its own."""
    global _process
    if _process[0] != os.getpid():
        _process = (os.getpid(), secrets.token_hex(16))
    return _process[1]


def proof(secret: bytes, label: str, *nonces: str) -> str:
    """HMAC-SHA256 over a direction label and both nonces (challenge-response)."""
    mac = hmac.new(secret, label.encode(), hashlib.sha256)
    for n in nonces:
        mac.update(b"\0" + n.encode())
    return mac.hexdigest()


def check_proof(secret: bytes | None, got: object, label: str, *nonces: str) -> bool:
    if secret is None:
        return got is None
    return isinstance(got, str) and hmac.compare_digest(got, proof(secret, label, *nonces))


# ---------------------------------------------------------------------- channels

_HTTP_STARTS = (b"GET ", b"POST", b"PUT ", b"HEAD", b"DELE", b"OPTI", b"PATC", b"CONN", b"TRAC",
                b"PRI ", b"HTTP")


def frame_too_large(head: bytes, n: int, max_frame: int) -> str:
    """The error for a length prefix over ``max_frame``, naming a stranger when the 4
    bytes are not a length at all (an HTTP request, a TLS handshake, a text protocol)."""
    what = None
    if head in _HTTP_STARTS:
        what = "HTTP"
    elif head[0] == 0x16 and head[1] == 0x03:
        what = "a TLS handshake"
    elif all(32 <= b < 127 or b in b"\t\r\n" for b in head):
        what = "text"
    if what is None:
        return f"control frame of {n} bytes exceeds {max_frame}"
    return (f"not a kvengine peer: the first bytes look like {what} ({head!r}), not a frame length "
            f"(read as {n} bytes, over the {max_frame} allowed)")
