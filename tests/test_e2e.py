"""End to end: a real (small, random) Llama from transformers, prefill here and decode
in a child process, the KV cache pushed layer by layer through kvengine while
the prefill forward runs (examples/disagg_llama). The tokens must equal a
single process's greedy ``model.generate``, over shm and over tcp: with one KV
row per request, and paged (block pools, block tables, two requests' blocks
interleaved; and a TP=2 decode pair, each rank holding half the KV heads).

Needs the ``e2e`` extra (``pip install -e ".[test,e2e]"``): without torch and
transformers these tests fail, they do not skip. ``pytest -s`` prints the
timings; they are also written to benchmarks/results/e2e_llama.json.
"""

import asyncio
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import kvengine as kv

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "disagg_llama"
RESULTS = ROOT / "benchmarks" / "results" / "e2e_llama.json"

try:
    import torch  # noqa: F401
    import transformers  # noqa: F401  (the example needs it)
except ImportError as e:  # pragma: no cover - CI installs the extra
    MISSING = (f"tests/test_e2e.py needs torch and transformers ({e}): "
               f"install the e2e extra: pip install -e '.[test,e2e]'")
else:
    MISSING = None
    sys.path.insert(0, str(EXAMPLE))
    import model as llama  # noqa: E402  (examples/disagg_llama/model.py)
    import run as disagg   # noqa: E402  (examples/disagg_llama/run.py)

PROMPT_LENS = (5, 64, 300)     # three prompts of different lengths
NEW_TOKENS = 12
MAX_SEQ = 320                  # tokens per KV row
_figures: dict = {}            # "transport/loop" -> run_session() result, written to RESULTS


def _save(name: str, res: dict) -> None:
    _figures[name] = res
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"prompt_lens": PROMPT_LENS, "new_tokens": NEW_TOKENS, "max_seq": MAX_SEQ,
                                   "cpus": os.cpu_count(), "runs": _figures}, indent=1))


def _need_extra():
    if MISSING:
        pytest.fail(MISSING, pytrace=False)


@pytest.fixture(scope="module")
def ref():
    """The model, the prompts and what a single process generates for them."""
    _need_extra()
    spec = llama.ModelSpec()
    model = llama.build_model(spec)
    prompts = disagg.make_prompts(PROMPT_LENS, spec.vocab_size)
    want = [llama.reference_generate(model, p, NEW_TOKENS) for p in prompts]
    return spec, model, prompts, want


def test_wrong_kv_changes_tokens(ref):
    """The comparison is sensitive: decoding from a cache whose last layer's values are
    damaged, or from another prompt's cache, gives other tokens; from an exact copy
    rebuilt through the kvengine layout, the same tokens."""
    spec, model, prompts, want = ref
    p = prompts[1]
    ids = torch.tensor([p])
    dyn = llama.new_dynamic_cache()
    first = int(llama.forward(model, ids, dyn).argmax())
    k, v = llama.layer_kv(dyn, spec.num_layers - 1)
    # an exact round trip through the (rows, kv_heads, max_seq, head_dim) layout
    tensors = [torch.zeros(2, spec.num_kv_heads, MAX_SEQ, spec.head_dim) for _ in range(2 * spec.num_layers)]
    for i in range(spec.num_layers):
        ki, vi = llama.layer_kv(dyn, i)
        tensors[2 * i][1, :, :len(p)] = ki[0]
        tensors[2 * i + 1][1, :, :len(p)] = vi[0]
    arrays = [t.numpy() for t in tensors]
    assert llama.greedy_continue(model, llama.cache_from_rows(arrays, 1, len(p)), first, NEW_TOKENS) == want[1]
    # one layer damaged
    arrays[2 * spec.num_layers - 1][1, :, :len(p) - 1] *= 0.5
    assert llama.greedy_continue(model, llama.cache_from_rows(arrays, 1, len(p)), first, NEW_TOKENS) != want[1]
    # another prompt's KV (same length, same first token)
    other = disagg.make_prompts([len(p)], spec.vocab_size, seed=7)[0]
    dyn2 = llama.new_dynamic_cache()
    llama.forward(model, torch.tensor([other]), dyn2)
    assert llama.greedy_continue(model, dyn2, first, NEW_TOKENS) != want[1]
    assert len(set(want[1])) > NEW_TOKENS // 2, f"the random model repeats itself: {want[1]}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_disaggregated_generation_matches_single_process(ref, transport):
    spec, model, prompts, want = ref
    loop_name = "uvloop" if "uvloop" in type(asyncio.get_running_loop()).__module__ else "asyncio"
    res = await disagg.run_session(prompts, NEW_TOKENS, transport=transport, spec=spec, rows=2,
                                   max_seq=MAX_SEQ, modes=("layerwise", "after"), warmup=True,
                                   model=model, log=lambda s: print(s))
    assert res["link_transport"] == transport
    print()
    disagg.print_report(res)

    for r in res["requests"]:
        i = r["prompt_index"]
        assert r["tokens"] == want[i], (
            f"{transport}: {r['id']} (prompt of {len(prompts[i])} tokens, {r['mode']}): disaggregated "
            f"generation gave {r['tokens']}, single-process generate() gave {want[i]}")
    # the layer-wise pushes really overlapped the forward: some request had layer 0
    # in the decode engine before its forward pass returned
    layerwise = [r for r in res["requests"] if r["mode"] == "layerwise"]
    assert any(r["layer0_landed_before_forward_end"] for r in layerwise), layerwise

    _save(f"{transport}/{loop_name}", res)
    s = res["summary"]
    print(f"E2E {transport}/{loop_name}: exposed transfer time (median over {len(prompts)} prompts): "
          f"layer-wise {s['layerwise']['exposed_ms']:.2f} ms of {s['layerwise']['transfer_ms']:.2f} ms, "
          f"after-forward baseline {s['after']['exposed_ms']:.2f} ms; "
          f"{res['kv_bytes_per_request'] / 2**20:.2f} MiB per request -> {RESULTS.relative_to(ROOT)}")


BLOCK = 16                     # tokens per block (paged)


def test_wrong_block_table_changes_tokens(ref):
    """The paged comparison is sensitive too: the request's blocks gathered through the
    right table rebuild the DynamicCache exactly (same tokens); a wrong block in the
    table, or one TP rank's heads of one block damaged, give other tokens."""
    spec, model, prompts, want = ref
    p = prompts[1]                                       # 64 tokens: 4 blocks
    dyn = llama.new_dynamic_cache()
    first = int(llama.forward(model, torch.tensor([p]), dyn).argmax())
    pool = [torch.zeros(12, spec.num_kv_heads, BLOCK, spec.head_dim) for _ in range(2 * spec.num_layers)]
    table = torch.tensor([9, 2, 7, 4])
    for i in range(spec.num_layers):
        llama.write_blocks(pool[2 * i], pool[2 * i + 1], table, *llama.layer_kv(dyn, i))
    arrays = [t.numpy() for t in pool]
    assert llama.greedy_continue(model, llama.cache_from_blocks(arrays, table.tolist(), len(p)), first,
                                 NEW_TOKENS) == want[1]
    # a table naming a wrong block (another request's: here a zero block). A permuted table
    # would not show: the keys carry their positions (RoPE), attention sums over them.
    wrong = [9, 2, 7, 5]
    assert llama.greedy_continue(model, llama.cache_from_blocks(arrays, wrong, len(p)), first,
                                 NEW_TOKENS) != want[1]
    arrays[1][7, spec.num_kv_heads // 2:] *= 0.5        # rank 1's heads of one block, layer 0 values
    assert llama.greedy_continue(model, llama.cache_from_blocks(arrays, table.tolist(), len(p)), first,
                                 NEW_TOKENS) != want[1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [1, 2], ids=["paged", "paged-tp2"])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_paged_disaggregated_generation_matches_single_process(ref, transport, tp):
    """Block pools on both sides, a block table per request (torch tensors), two requests'
    blocks interleaved in one pool; tp=2: two decode ranks each holding half the KV heads
    (a head-split push of each block), their attention outputs combined per layer."""
    from kvengine.plan import run_arrays
    spec, model, prompts, want = ref
    res = await disagg.run_paged_session(prompts, NEW_TOKENS, transport=transport, spec=spec, num_blocks=64,
                                         block_size=BLOCK, tp=tp, modes=("layerwise",), warmup=True,
                                         torch_threads=1, model=model, log=lambda s: print(s))
    assert res["link_transport"] == transport
    print()
    disagg.print_report(res)
    reqs = res["requests"]
    assert len(reqs) == len(prompts) + 1
    for r in reqs:
        i = r["prompt_index"]
        assert r["tokens"] == want[i], (
            f"{transport} tp={tp}: {r['id']} (prompt of {len(prompts[i])} tokens): paged disaggregated "
            f"generation gave {r['tokens']}, single-process generate() gave {want[i]}")
        assert len(r["src_blocks"]) == -(-len(prompts[i]) // BLOCK)
        # nothing coalesces: no two table entries consecutive on both sides
        rs, _, counts = run_arrays(np.array(r["src_blocks"]), np.array(r["dst_blocks"]))
        assert counts.max() == 1, (r["src_blocks"], r["dst_blocks"])
    by_id = {r["id"]: r for r in reqs}
    pairs = {tuple(r["pair"]) for r in reqs}
    assert len(pairs) == 2 and all(len(p) == 2 for p in pairs)
    for a, b in pairs:                 # the two requests' blocks alternate in both pools
        for side in ("src_blocks", "dst_blocks"):
            owner = sorted([(x, 0) for x in by_id[a][side]] + [(x, 1) for x in by_id[b][side]])
            k = 2 * min(len(by_id[a][side]), len(by_id[b][side]))
            assert all(owner[j][1] != owner[j + 1][1] for j in range(k - 1)), (side, owner)
    long = by_id["req-2-layerwise"]["src_blocks"]
    assert long != sorted(long), "a table in pool order"
    assert any(r["layer0_landed_before_forward_end"] for r in reqs), reqs
    if tp == 2:                        # each rank's pool holds half the KV heads; the ranks' outputs combined
        assert res["rank_pool_shapes"] == [[64, spec.num_kv_heads // 2, BLOCK, spec.head_dim]] * 2
        assert res["all_reduces"] == len(reqs) * (NEW_TOKENS - 1) * spec.num_layers
    loop_name = "uvloop" if "uvloop" in type(asyncio.get_running_loop()).__module__ else "asyncio"
    _save(f"{transport}/{loop_name}/paged-tp{tp}", res)


def test_e2e_extra_installed():
    """Fails (not skips) when the e2e extra is missing, so CI notices."""
    _need_extra()
    assert kv.KvEngine is not None
