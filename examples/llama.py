"""A Llama-style decoder to plan with `bigbatch plan --model examples.llama:llama3_8b`.

Pre-norm blocks with RMSNorm, grouped-query attention with rotary positions, a SwiGLU MLP
and an untied output head; the sizes of Llama 3's 8B, 70B and 405B (Meta's model cards:
layers, width, heads, key/value heads, MLP width, vocabulary 128256). `gpt()` builds the
GPT shape Megatron-LM's tables use (LayerNorm, a GELU MLP of 4 d, as many key/value heads
as heads). Each model carries its `model_plan()` (Megatron's tensor split; pipeline layers:
the embedding, each block, the final norm, the head), which `bigbatch plan` reads.

    bigbatch plan --model examples.llama:llama3_8b --seq-len 8192 --world 8 \\
        --set sharding.stage=3 --device h100

Built under ``torch.device("meta")`` it costs nothing, at any size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bigbatch.parallel.model_plan import ModelPlan
from bigbatch.parallel.pipeline import Layer, module_layer

__all__ = ["TP_PLAN", "Decoder", "gpt", "llama", "llama3_8b", "llama3_70b", "llama3_405b",
           "megatron_1t"]

TP_PLAN = {
    "tok_emb": "vocab_embedding",
    "blocks.*.attn.wq": "colwise", "blocks.*.attn.wk": "colwise",
    "blocks.*.attn.wv": "colwise", "blocks.*.attn.wo": "rowwise",
    "blocks.*.mlp.w1": "colwise", "blocks.*.mlp.w3": "colwise",
    "blocks.*.mlp.w2": "rowwise",
    "head": "vocab_head",
}
"""Megatron's split: heads (query and key/value alike) and the MLP's hidden units column-
then row-wise, the embedding and the head on the vocabulary."""


def _rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` (batch, heads, time, head_dim)."""
    t, d = x.shape[-2], x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), freqs)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Grouped-query causal attention. Head counts are read off the local widths, so the
    same code runs whole and split by heads."""

    def __init__(self, d_model: int, n_head: int, n_kv_head: int, rope_theta: float | None):
        super().__init__()
        self.head_dim = d_model // n_head
        self.wq = nn.Linear(d_model, n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(d_model, n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(d_model, n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(n_head * self.head_dim, d_model, bias=False)
        self.rope_theta = rope_theta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        if self.rope_theta is not None:
            q, k = _rotate(q, self.rope_theta), _rotate(k, self.rope_theta)
        if k.shape[1] != q.shape[1]:  # each key/value head serves a group of query heads
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GeluMLP(nn.Module):
    """GPT's MLP; named like SwiGLU's up (w1) and down (w2) so one plan splits both."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden)
        self.w2 = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, n_kv_head: int, hidden: int, *,
                 gpt_shape: bool, rope_theta: float | None, eps: float):
        super().__init__()
        norm = (lambda: nn.LayerNorm(d_model, eps=eps)) if gpt_shape else \
            (lambda: nn.RMSNorm(d_model, eps=eps))
        self.attn_norm, self.mlp_norm = norm(), norm()
        self.attn = Attention(d_model, n_head, n_kv_head, rope_theta)
        self.mlp = GeluMLP(d_model, hidden) if gpt_shape else SwiGLU(d_model, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Token embedding, blocks, a final norm, an untied head (logits over the vocabulary).
    `max_seq_len` is the context the published runs train at (`bigbatch plan`'s default
    ``--seq-len``). ``dtype="bfloat16"`` builds it in bf16, as Megatron-LM and Llama 3 run
    every activation (autocast keeps the residual stream in float32)."""

    def __init__(self, *, vocab: int, d_model: int, n_layer: int, n_head: int,
                 n_kv_head: int | None = None, hidden: int | None = None,
                 max_seq_len: int = 8192, gpt_shape: bool = False,
                 rope_theta: float | None = 500000.0, eps: float = 1e-5,
                 dtype: str | None = None):
        super().__init__()
        n_kv_head = n_kv_head or n_head
        hidden = hidden or 4 * d_model
        self.max_seq_len = max_seq_len
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(max_seq_len, d_model) if gpt_shape else None
        self.blocks = nn.ModuleList(
            Block(d_model, n_head, n_kv_head, hidden, gpt_shape=gpt_shape,
                  rope_theta=None if gpt_shape else rope_theta, eps=eps)
            for _ in range(n_layer))
        self.norm = nn.LayerNorm(d_model, eps=eps) if gpt_shape else nn.RMSNorm(d_model, eps=eps)
        self.head = nn.Linear(d_model, vocab, bias=False)
        if dtype is not None:
            self.to(getattr(torch, dtype))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(ids)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(ids.shape[1], device=ids.device))
        return x

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def pipeline_layers(self) -> list[Layer]:
        names = ("tok_emb",) if self.pos_emb is None else ("tok_emb", "pos_emb")
        return [Layer("embed", names, Decoder.embed),
                *(module_layer(f"blocks.{i}") for i in range(len(self.blocks))),
                module_layer("norm"), module_layer("head")]

    def model_plan(self) -> ModelPlan:
        return ModelPlan(blocks=(Block,), tp_plan=dict(TP_PLAN))


def llama(vocab: int = 128256, **shape) -> Decoder:
    """A Llama-3-shaped decoder of any size (`Decoder`'s keywords)."""
    return Decoder(vocab=vocab, **shape)


def llama3_8b(**over) -> Decoder:
    """Llama 3 8B: 32 layers, d 4096, 32 heads, 8 key/value heads, MLP 14336."""
    return llama(**{"d_model": 4096, "n_layer": 32, "n_head": 32, "n_kv_head": 8,
                    "hidden": 14336, **over})


def llama3_70b(**over) -> Decoder:
    """Llama 3 70B: 80 layers, d 8192, 64 heads, 8 key/value heads, MLP 28672."""
    return llama(**{"d_model": 8192, "n_layer": 80, "n_head": 64, "n_kv_head": 8,
                    "hidden": 28672, **over})


def llama3_405b(**over) -> Decoder:
    """Llama 3 405B: 126 layers, d 16384, 128 heads, 8 key/value heads, MLP 53248."""
    return llama(**{"d_model": 16384, "n_layer": 126, "n_head": 128, "n_kv_head": 8,
                    "hidden": 53248, **over})


def gpt(vocab: int = 51200, **shape) -> Decoder:
    """A GPT-shaped decoder (LayerNorm, GELU MLP of 4 d, learned positions), vocabulary
    51200 as in Megatron-LM's tables."""
    return Decoder(vocab=vocab, gpt_shape=True, **{"max_seq_len": 2048, **shape})


def megatron_1t(**over) -> Decoder:
    """Megatron-LM's 1T-parameter GPT (Narayanan et al. 2021, Table 1): 128 layers,
    d 25600, 160 heads, sequence 2048."""
    return gpt(**{"d_model": 25600, "n_layer": 128, "n_head": 160, **over})
