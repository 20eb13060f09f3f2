"""Shared caches are mapped with their pages faulted in for writing.

A page faulted in for reading (MAP_POPULATE) took the first copy into it at about half
the speed of later ones on this project's VMs (benchmarks/first_write.c; docs/
benchmarks.md, "The first write into a page"). The kernel does not say how a page was
faulted in, but on a memfd nobody wrote yet a page faulted in for reading is a clean
page (smaps ``*_Clean``) and one faulted in for writing a dirty one (``*_Dirty``):
that is what these tests read. They cannot tell MADV_POPULATE_WRITE alone from
MAP_POPULATE followed by it (dirty either way, but the second is as slow as
MAP_POPULATE alone): the code's comments say why it must be the first."""

from __future__ import annotations

import ctypes
import os

import numpy as np

import kvengine as kv
from kvengine import _native

MiB = 1 << 20


def smaps_of(addr: int) -> dict[str, int]:
    """The kB fields of /proc/self/smaps for the mapping that starts at ``addr``."""
    fields: dict[str, int] = {}
    mine = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                mine = int(head.split("-")[0], 16) == addr
            elif mine and line.split()[-1] == "kB":
                fields[head.rstrip(":")] = int(line.split()[1])
    assert fields, f"no mapping starts at {addr:#x}"
    return fields


def dirty_kb(f: dict[str, int]) -> int:
    return f["Private_Dirty"] + f["Shared_Dirty"]


def test_a_peers_memfd_is_mapped_with_every_page_faulted_in_for_writing():
    n = 16 * MiB
    fd = os.memfd_create("kvengine-test", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, n)
        st, addr = _native.map_fd(fd, n)
        assert st == 0 and addr
        try:
            f = smaps_of(addr)
            assert f["Rss"] == n // 1024, f
            assert dirty_kb(f) == n // 1024, f"pages faulted in for reading only: {f}"
        finally:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            assert libc.munmap(addr, n) == 0
    finally:
        os.close(fd)


async def test_an_allocated_cache_is_faulted_in_for_writing():
    e = await kv.KvEngine(7, kv.Role.DECODER, "127.0.0.1:0", kv.EngineOptions(transport="tcp")).start()
    try:
        c = e.allocate_cache(kv.CacheDesc(2, (4, MiB), np.uint8))
        # the tensors are laid out in one memfd mapping, tensor 0 at its start
        f = smaps_of(c.tensors[0].ctypes.data)
        assert f["Rss"] == 2 * 4 * MiB // 1024, f
        assert dirty_kb(f) == f["Rss"], f"pages faulted in for reading only: {f}"
    finally:
        await e.close()
