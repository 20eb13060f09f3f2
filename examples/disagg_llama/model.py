"""The model both workers run: a small Llama from Hugging Face ``transformers``,
random weights from a fixed seed (nothing is downloaded, no tokenizer: prompts
are lists of token ids), plus the few helpers that differ between
``transformers`` versions.

KV layout shared by both sides (one kvengine cache)::

    num_tensors = 2 * num_layers          K0, V0, K1, V1, ...   (tensor_num_per_layer=2)
    shape       = (rows, num_kv_heads, max_seq, head_dim)       float32
    row r, tensor 2*i   = layer i keys   of the request in slot r, positions [0, prompt_len)
    row r, tensor 2*i+1 = layer i values of the request in slot r

which is exactly the per-layer ``(batch, num_kv_heads, seq, head_dim)`` tensor of
a ``DynamicCache`` (keys after RoPE), so a copy in and a slice out is all it takes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
from typing import Sequence

import numpy as np
import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

__all__ = ["ModelSpec", "build_model", "kv_cache_desc", "paged_cache_desc", "write_blocks", "gather_blocks",
           "cache_from_blocks", "layer_kv", "new_dynamic_cache",
           "cache_from_rows", "forward", "greedy_continue", "reference_generate", "weights_digest"]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Everything that determines the model's weights (both sides build it from this)."""
    num_layers: int = 4
    hidden_size: int = 256
    intermediate_size: int = 688
    num_heads: int = 8
    num_kv_heads: int = 4
    vocab_size: int = 1024
    max_position_embeddings: int = 2048
    # Larger than Llama's 0.02 so that a random model's next token depends strongly on
    # the context (with 0.02 it mostly repeats one token, which would make a poor test).
    initializer_range: float = 0.1
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, s: str) -> "ModelSpec":
        return cls(**json.loads(s))


def build_model(spec: ModelSpec) -> LlamaForCausalLM:
    """The same weights in every process: ``torch.manual_seed(spec.seed)`` then init."""
    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,   # never stop early
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).eval()
    model.requires_grad_(False)
    return model


def weights_digest(model: torch.nn.Module) -> str:
    """Short hash of every parameter, to check both processes built the same model."""
    h = hashlib.blake2b(digest_size=8)
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def kv_cache_desc(kv, spec: ModelSpec, rows: int, max_seq: int):
    """The kvengine ``CacheDesc`` of the layout above."""
    return kv.CacheDesc(num_tensors=2 * spec.num_layers,
                        shape=(rows, spec.num_kv_heads, max_seq, spec.head_dim), dtype=np.float32)


# ------------------------------------------------------- transformers versions

_FORWARD_PARAMS = inspect.signature(LlamaForCausalLM.forward).parameters
# transformers 5.x renamed the forward argument ``past_key_values`` to ``cache``.
_CACHE_KW = "cache" if "cache" in _FORWARD_PARAMS else "past_key_values"
# Logits of the last position only, as generate() does (``num_logits_to_keep`` before 4.50).
_KEEP_KW = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in _FORWARD_PARAMS), None)


def layer_kv(cache: DynamicCache, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``i``'s (keys, values) in a DynamicCache, each (batch, kv_heads, seq, head_dim).

    transformers >= 4.54 keeps them in ``cache.layers[i].keys / .values``
    (``DynamicLayer``); older versions in ``cache.key_cache[i] / value_cache[i]``.
    """
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[i].keys, layers[i].values
    return cache.key_cache[i], cache.value_cache[i]


def new_dynamic_cache() -> DynamicCache:
    return DynamicCache()


def cache_from_rows(tensors: Sequence[np.ndarray], row: int, length: int) -> DynamicCache:
    """A DynamicCache holding positions [0, length) of ``row`` of a kvengine cache (copied)."""
    cache = new_dynamic_cache()
    for i in range(len(tensors) // 2):
        k = torch.from_numpy(tensors[2 * i][row, :, :length]).clone(memory_format=torch.contiguous_format)
        v = torch.from_numpy(tensors[2 * i + 1][row, :, :length]).clone(memory_format=torch.contiguous_format)
        cache.update(k.unsqueeze(0), v.unsqueeze(0), i)
    return cache


def forward(model: LlamaForCausalLM, input_ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """One forward pass that appends to ``cache``; returns the last position's logits."""
    kwargs = {_CACHE_KW: cache}
    if _KEEP_KW:
        kwargs[_KEEP_KW] = 1
    with torch.inference_mode():
        out = model(input_ids=input_ids, use_cache=True, **kwargs)
    return out.logits[0, -1]


def greedy_continue(model: LlamaForCausalLM, cache: DynamicCache, first_token: int,
                    max_new_tokens: int) -> list[int]:
    """Greedy decoding from a cache that holds the whole prompt.

    ``first_token`` is the argmax of the prompt's last position (the prefill computed
    it); each step feeds the previous token and appends its K/V to the cache.
    """
    tokens = [first_token]
    while len(tokens) < max_new_tokens:
        logits = forward(model, torch.tensor([[tokens[-1]]]), cache)
        tokens.append(int(logits.argmax()))
    return tokens


def reference_generate(model: LlamaForCausalLM, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """What a single process produces: ``model.generate`` greedy."""
    ids = torch.tensor([list(prompt)])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def versions() -> dict:
    return {"torch": torch.__version__, "transformers": transformers.__version__}


# ------------------------------------------------------------------ paged KV

def paged_cache_desc(kv, spec: ModelSpec, num_blocks: int, block_size: int, kv_heads: int | None = None):
    """The kvengine ``CacheDesc`` of a block pool (``--layout paged``)::

        num_tensors = 2 * num_layers        K0, V0, K1, V1, ...
        shape       = (num_blocks, kv_heads, block_size, head_dim)     float32

    Dim 0 is the block id (what block tables name). Inside a block the heads are
    outermost, so heads [h0, h1) of a block are one contiguous range: a pool of
    ``kv_heads / R`` heads per block is, byte for byte, the same memory cut into
    ``R`` times as many blocks (see ``paged.head_split_view``). Block ``b`` of a
    request holds its positions ``[b * block_size, (b + 1) * block_size)``; gathered
    and transposed, the blocks are the DynamicCache's ``(1, kv_heads, seq, head_dim)``.
    """
    heads = spec.num_kv_heads if kv_heads is None else kv_heads
    return kv.CacheDesc(num_tensors=2 * spec.num_layers, shape=(num_blocks, heads, block_size, spec.head_dim),
                        dtype=np.float32)


def write_blocks(pool_k: torch.Tensor, pool_v: torch.Tensor, table: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor) -> None:
    """Copy one layer's (1, kv_heads, n, head_dim) keys/values into the pool blocks ``table``
    (block j of the table takes positions [j * block_size, (j + 1) * block_size))."""
    nb, bs = table.numel(), pool_k.shape[2]
    n = k.shape[2]
    for pool, x in ((pool_k, k), (pool_v, v)):
        pad = x.new_zeros(x.shape[1], nb * bs, x.shape[3])
        pad[:, :n] = x[0]
        pool[table] = pad.view(x.shape[1], nb, bs, x.shape[3]).transpose(0, 1)


def gather_blocks(pool: torch.Tensor, table: Sequence[int], length: int) -> torch.Tensor:
    """Positions [0, length) of a request's blocks as (1, kv_heads, length, head_dim) (a copy)."""
    g = pool[torch.as_tensor(list(table), dtype=torch.long)]          # (nb, heads, bs, dim)
    nb, heads, bs, dim = g.shape
    return g.transpose(0, 1).reshape(heads, nb * bs, dim)[:, :length].unsqueeze(0).contiguous()


def cache_from_blocks(tensors: Sequence[np.ndarray], table: Sequence[int], length: int) -> DynamicCache:
    """A DynamicCache holding positions [0, length) of the blocks ``table`` of a pool (copied)."""
    cache = new_dynamic_cache()
    for i in range(len(tensors) // 2):
        k = gather_blocks(torch.from_numpy(tensors[2 * i]), table, length)
        v = gather_blocks(torch.from_numpy(tensors[2 * i + 1]), table, length)
        cache.update(k, v, i)
    return cache
