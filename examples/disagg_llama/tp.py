"""Tensor parallelism, emulated: decode rank ``r`` of ``R`` holds KV heads
``[r * h, (r + 1) * h)`` (``h = num_kv_heads / R``) and their query heads, and
computes attention for those heads only; the ranks' outputs are combined once
per layer by an all-reduce (sum) of their row-parallel ``o_proj`` partial
products, as Megatron-style TP does. Everything else (embedding, norms, MLP,
``lm_head``) is replicated on every rank; every rank sees the same sum, so every
rank computes the same next token.

``all_reduce(partial) -> total`` is the caller's: in this example the driver
(``run.py``) plays it, summing the partials the ranks send it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

__all__ = ["RankDecoder"]


class RankDecoder:
    """Rank ``rank`` of ``ranks``: the slices of each layer's attention weights it holds."""

    def __init__(self, model, rank: int, ranks: int) -> None:
        cfg = model.config
        self.model = model
        self.dim = cfg.hidden_size // cfg.num_attention_heads
        if cfg.num_key_value_heads % ranks or cfg.num_attention_heads % ranks:
            raise ValueError(f"heads ({cfg.num_attention_heads}, {cfg.num_key_value_heads} kv) do not split "
                             f"over {ranks} ranks")
        self.q_heads = cfg.num_attention_heads // ranks
        self.kv_heads = cfg.num_key_value_heads // ranks
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        d = self.dim
        qs = slice(rank * self.q_heads * d, (rank + 1) * self.q_heads * d)
        ks = slice(rank * self.kv_heads * d, (rank + 1) * self.kv_heads * d)
        self.weights = []                       # per layer: (Wq, Wk, Wv) rows and Wo columns of this rank
        for layer in model.model.layers:
            a = layer.self_attn
            self.weights.append((a.q_proj.weight[qs].contiguous(), a.k_proj.weight[ks].contiguous(),
                                 a.v_proj.weight[ks].contiguous(), a.o_proj.weight[:, qs].contiguous()))

    def generate(self, keys: list[torch.Tensor], values: list[torch.Tensor], prompt_len: int, first_token: int,
                 max_new_tokens: int, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> list[int]:
        """Greedy decoding from this rank's heads of the prompt's KV (per layer
        ``(1, kv_heads / R, prompt_len, head_dim)``); ``first_token`` came from the prefill."""
        tokens = [first_token]
        keys, values = list(keys), list(values)
        with torch.inference_mode():
            while len(tokens) < max_new_tokens:
                logits = self._step(tokens[-1], prompt_len + len(tokens) - 1, keys, values, all_reduce)
                tokens.append(int(logits.argmax()))
        return tokens

    def _step(self, token: int, pos: int, keys: list[torch.Tensor], values: list[torch.Tensor],
              all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        m = self.model.model
        h = m.embed_tokens(torch.tensor([[token]]))                        # (1, 1, hidden)
        cos, sin = m.rotary_emb(h, torch.tensor([[pos]]))
        for i, layer in enumerate(m.layers):
            wq, wk, wv, wo = self.weights[i]
            x = layer.input_layernorm(h)
            q = F.linear(x, wq).view(1, 1, self.q_heads, self.dim).transpose(1, 2)
            k = F.linear(x, wk).view(1, 1, self.kv_heads, self.dim).transpose(1, 2)
            v = F.linear(x, wv).view(1, 1, self.kv_heads, self.dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys[i] = torch.cat([keys[i], k], dim=2)
            values[i] = torch.cat([values[i], v], dim=2)
            o = F.scaled_dot_product_attention(q, repeat_kv(keys[i], self.groups), repeat_kv(values[i], self.groups),
                                               scale=layer.self_attn.scaling)
            partial = F.linear(o.transpose(1, 2).reshape(1, 1, self.q_heads * self.dim), wo)
            h = h + all_reduce(partial)                                     # the ranks' outputs combined
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(m.norm(h))[0, -1]


def combine(partials: Sequence[torch.Tensor]) -> torch.Tensor:
    """The all-reduce: the sum of the ranks' partials, in rank order."""
    out = partials[0].clone()
    for p in partials[1:]:
        out += p
    return out
