"""Layer streams to block destinations take block tables as lists, numpy int arrays
and CPU torch tensors (one table for every destination, or one per destination)."""

import numpy as np
import pytest

import kvengine as kv
from kvengine import LLMStatusCode as S
from conftest import filled, link, make_pair

try:
    import torch
except ImportError:  # pragma: no cover - the e2e extra installs it
    torch = None


def _tables(kind, src, dsts):
    if kind == "list":
        return list(src), [list(d) for d in dsts]
    if kind == "numpy":
        return np.array(src, np.int32), [np.array(d, np.int64) for d in dsts]
    if kind.startswith("torch") and torch is None:
        pytest.fail("torch missing: install the e2e extra", pytrace=False)
    if kind == "torch":
        return torch.tensor(src, dtype=torch.int32), [torch.tensor(d) for d in dsts]
    if kind == "torch-2d":
        return torch.tensor(src), torch.tensor([list(d) for d in dsts])
    raise AssertionError(kind)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("kind", ["list", "numpy", "torch", "torch-2d"])
async def test_layer_stream_block_tables(transport, kind):
    p, d = await make_pair(transport)
    try:
        await link(p, d)
        layers, pool = 3, 12
        desc = kv.CacheDesc(2 * layers, (pool, 4, 64), np.uint8)
        src = filled(p.allocate_cache(desc), 3)
        dst_a, dst_b = d.allocate_cache(desc), d.allocate_cache(desc)
        for c in (dst_a, dst_b):
            await p.wait_remote_cache(2, c.cache_id)
        sblocks = [7, 2, 9, 4, 0]                        # non-monotone: nothing coalesces
        dblocks = [[3, 11, 1, 6, 8], [10, 5, 0, 2, 9]]
        sb, dbs = _tables(kind, sblocks, dblocks)
        keys = [kv.BlocksCacheKey(2, dst_a.cache_id), kv.BlocksCacheKey(2, dst_b.cache_id)]
        stream = p.layer_stream(src, keys, timeout=30, notify=b"blk", src_blocks=sb, dst_blocks=dbs)
        if kind == "torch":
            sb.fill_(1)                                  # the stream copied the table when it opened
        for i in range(layers):
            stream.layer_ready(i)
        assert await stream.wait() == [S.LLM_SUCCESS, S.LLM_SUCCESS]
        for c, db in zip((dst_a, dst_b), dblocks):
            for t in range(desc.num_tensors):
                assert np.array_equal(c.tensors[t][db], src.tensors[t][sblocks]), (kind, t)
                others = np.setdiff1d(np.arange(pool), db)
                assert not c.tensors[t][others].any()
        await d.wait_notification(b"blk", timeout=5)
    finally:
        await p.close()
        await d.close()


async def test_layer_stream_one_table_for_every_destination_and_bad_tables():
    p, d = await make_pair("shm")
    try:
        await link(p, d)
        desc = kv.CacheDesc(2, (8, 32), np.uint8)
        src = filled(p.allocate_cache(desc), 4)
        dsts = [d.allocate_cache(desc) for _ in range(2)]
        for c in dsts:
            await p.wait_remote_cache(2, c.cache_id)
        keys = [kv.BlocksCacheKey(2, c.cache_id) for c in dsts]
        one = np.array([5, 1, 6])
        stream = p.layer_stream(src, keys, timeout=30, src_blocks=[0, 3, 2], dst_blocks=one)
        stream.layer_ready(0)
        assert await stream.wait() == [S.LLM_SUCCESS] * 2
        for c in dsts:
            assert np.array_equal(c.tensors[1][one], src.tensors[1][[0, 3, 2]])
        with pytest.raises(kv.LLMParamInvalidError, match="1-D integer"):
            p.layer_stream(src, keys, timeout=30, src_blocks=np.array([0.0, 1.0]), dst_blocks=one)
        with pytest.raises(kv.LLMParamInvalidError, match="one block table per destination"):
            p.layer_stream(src, keys, timeout=30, src_blocks=[0], dst_blocks=[[1], [2], [3]])
    finally:
        await p.close()
        await d.close()
