"""How a shm link's control socket closes, and who may still write into our memory.

Owns: the shm links that went down and whose socket is not closed yet (each
end's EOF is its word that its movers are out of the other's memory), the
wait of an unregister on them, and the warning an operator reads when a peer
that may still write does not finish.

On a shm link each end's movers copy straight into the other's memory: into
a memfd both map, or with process_vm_writev (CMA) into memory the caller
registered. A mover checks its lease before each chunk, but a process stopped
(SIGSTOP, a debugger) between that check and its copy writes the chunk when it
resumes, however late. Nothing we do can revoke that: the kernel lets any
process of our user write our memory with CMA. So a link that goes down closes
in two steps (docs/protocol.md, "Closing a shm link"): once none of our movers
is inside a chunk under the link's lease (``kv_lease_busy``, waited for at most
heartbeat_timeout), we shut our end for writing; the socket closes when the
peer has shut its end too (or died: the kernel closes it). Until then a cache
of caller-owned memory that was registered while the link was up is not
reported released (``unregister_kv_cache``'s future, kvengine/registry.py).
memfd caches need no such wait: their pages are never handed back to the
caller.
"""

from __future__ import annotations

import asyncio
import logging

from .channels import SeqpacketChannel
from .link import Link, TaskSet
from .native import _native

__all__ = ["ShmClosings"]

log = logging.getLogger("kvengine")

_POLL = 0.001   # how often a closing link asks whether our movers are out (a chunk is ~0.1 ms)


class ShmClosings:
    """Down shm links whose socket is still open (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, core: _native.Core, tasks: TaskSet,
                 heartbeat_timeout: float, link_timeout: float) -> None:
        self._loop = loop
        self._core = core
        self._tasks = tasks
        self._hbt = heartbeat_timeout
        self._link_timeout = link_timeout
        self._open: dict[Link, tuple[float, asyncio.Future[None]]] = {}   # link -> (down at, closed)

    def close(self, link: Link, lease_id: int) -> bool:
        """Close the control channel of a link that went down; True if it is a shm link
        (the socket then closes in two steps), False if the caller closes it."""
        ch = link.ch
        if link.transport != "shm" or not isinstance(ch, SeqpacketChannel):
            return False
        closed = ch.finish()
        if closed.done():
            return True
        self._open[link] = (self._loop.time(), closed)
        closed.add_done_callback(lambda _: self._open.pop(link, None))
        if lease_id and self._core.lease_busy(lease_id):
            self._tasks.spawn(self._after_movers(link, ch, lease_id))
        else:
            ch.shutdown_write()
        return True

    async def _after_movers(self, link: Link, ch: SeqpacketChannel, lease_id: int) -> None:
        limit = self._loop.time() + self._hbt
        while self._core.lease_busy(lease_id) and self._loop.time() < limit:
            await asyncio.sleep(_POLL)
        if self._core.lease_busy(lease_id):
            log.warning("link to cluster %s: a copy into its memory has not returned for %.2f s "
                        "(heartbeat_timeout; the peer holds its pages): closing the link anyway",
                        link.cluster_id, self._hbt)
        ch.shutdown_write()

    async def wait_writers(self, since: float, cache_id: int) -> None:
        """Wait until no shm peer that was linked at ``since`` (loop time) or later may
        still write into our memory: every such link that went down has closed."""
        waits = {link: closed for link, (down, closed) in self._open.items() if down >= since}
        if not waits:
            return
        done, pending = await asyncio.wait(waits.values(), timeout=self._link_timeout)
        if pending:
            late = [link for link, closed in waits.items() if closed in pending]
            log.warning("unregister_kv_cache(%s): the memory stays referenced until %s finish: their links "
                        "are down, but they have not closed them, and until they do their copy threads may "
                        "still write into it (process_vm_writev). A stopped or hung process keeps it so; "
                        "ending that process releases the memory", cache_id,
                        ", ".join(_who(link) for link in late))
            await asyncio.wait(pending)

    def summary(self) -> dict[int, dict[str, object]]:
        """cluster id -> the peer's pid and seconds since its link went down, for each shm
        link whose peer has not finished it yet (it may still write into our memory)."""
        now = self._loop.time()
        return {link.cluster_id: {"pid": link.peer_pid, "down_s": round(now - down, 3)}
                for link, (down, _) in self._open.items()}

    def close_all(self) -> None:
        """The engine closed (its movers are stopped): close every socket now."""
        for link in list(self._open):
            link.ch.close()


def _who(link: Link) -> str:
    return f"cluster {link.cluster_id} (pid {link.peer_pid}, {_state(link.peer_pid)})"


def _state(pid: int) -> str:
    """The process's state as the kernel reports it (for the operator reading the log)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        code = stat[stat.rindex(")") + 2]
    except (OSError, ValueError, IndexError):
        return "gone"
    return {"T": "stopped", "t": "stopped by a debugger", "Z": "exited", "D": "in uninterruptible sleep"}.get(
        code, f"state {code}")
