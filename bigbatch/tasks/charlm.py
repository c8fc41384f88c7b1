"""charlm: character-level language modelling on text that ships with Python.

The default corpus is `pydoc_data.topics.topics` (the help texts, about 465k characters),
joined in sorted-key order; the last 10% is held out. `corpus="stdlib"` reads the
standard library's own sources instead (about 12M characters, whole files held out;
`bigbatch.tasks.corpus`). The model is a small
decoder-only pre-LayerNorm Transformer, so LAMB's "no decay / no trust ratio on
norms and biases" rules have something to act on.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from bigbatch.config.limits import SEED_RULE
from bigbatch.errors import ConfigError
from bigbatch.parallel.pipeline import Layer, module_layer
from bigbatch.tasks._base import Recipe, Reduce, Task, eval_sums
from bigbatch.tasks.corpus import CORPORA, load_corpus, topics_text

IGNORE_INDEX = -100
"""Target value of padding positions: ignored by the loss and not counted."""

_RECIPES = {
    "transformer": Recipe(
        base_batch_size=16,
        base_lr=2e-3,
        epochs=4,
        optimizer="adamw",
        momentum=0.9,
        weight_decay=0.01,
        warmup_epochs=0.25,
        reference=1.9295,
        reference_note="AdamW, batch 16, lr 2e-3, 4 epochs, seq_len 64: held-out bits/char",
    ),
}


DEMO_STRATEGY = """\
# bigbatch train's default on charlm: LAMB whose batch grows from the AdamW
# recipe's 16 up to 128 (8x) with the measured noise scale (batch.schedule = "auto":
# the batch doubles while twice it is at most 0.0075 of the noise scale, LAMB's
# fraction, and the peak LR doubles with it). On 2 workers: 1.8928 bits/char in 1259
# steps against the AdamW recipe's 1.9295 in 1632 (23% fewer steps). LAMB takes its
# own LR at the base batch: it moves each weight tensor by about lr x its norm per
# step, so AdamW's 2e-3 left it at 2.71 bits/char where 0.011 gave 1.898 (AdamW: 1.95).
# A fixed 128 from the start gets 204 steps in the recipe's 4 epochs: 2.35.
# benchmarks/NOTES-lamb-charlm.md and benchmarks/NOTES-auto-batch.md have the runs.
[batch]
global_batch_size = 128
base_batch_size = 16
base_lr = 0.011
scaling = "sqrt"
warmup_epochs = 1
decay = "cosine"
schedule = "auto"

[optimizer]
type = "adamw"
weight_decay = 0.0
epsilon = 1e-6

[lamb]
lamb_weight_decay = 0.01
exclude_from_weight_decay = ["norm", "bias"]
"""


TENSOR_PARALLEL_PLAN = {
    "tok_emb": "vocab_embedding",
    "blocks.*.attn.qkv": "colwise",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.0": "colwise",
    "blocks.*.mlp.2": "rowwise",
    "head": "vocab_head",
}
"""Megatron's split of `CharTransformer`: attention heads and the MLP's hidden units
column- then row-wise, the embedding and the LM head on the vocabulary (padded to a
multiple of the degree; the loss runs on the sharded logits); `pos_emb` and the norms
replicated."""


def corpus() -> str:
    """The default (`topics`) corpus's full text, deterministic for a given Python version."""
    return topics_text()


def _windows(ids: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Non-overlapping windows; the target of a window's last position is the next window's
    # first character, so an epoch predicts every character once.
    n = (ids.numel() - 1) // seq_len
    x = ids[: n * seq_len].view(n, seq_len)
    y = ids[1 : n * seq_len + 1].view(n, seq_len)
    return x.clone(), y.clone()


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention. `qkv`'s outputs are head-major (per head: q, k, v),
    as in Megatron, so a column-wise split of `qkv` gives each rank whole heads; the number
    of heads is read off the local width, so the same code runs whole and split."""

    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.head_dim = d_model // n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)
        heads = qkv.shape[-1] // (3 * self.head_dim)
        q, k, v = qkv.view(b, t, heads, 3, self.head_dim).transpose(1, 2).unbind(dim=3)
        # Causal masking also makes right-padding harmless: real positions never see it.
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))


class Block(nn.Module):
    """Pre-LayerNorm Transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class CharTransformer(nn.Module):
    """Decoder-only Transformer over characters; output logits `(batch, time, vocab)`."""

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        d_model: int = 128,
        n_layer: int = 2,
        n_head: int = 4,
        dropout: float = 0.0,
        tie_weights: bool = True,
    ):
        super().__init__()
        if d_model % n_head:
            raise ConfigError(f"d_model={d_model} must be divisible by n_head={n_head}")
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, n_head, dropout) for _ in range(n_layer)))
        self.norm_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_weights:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init)
        # GPT-2's scaled init of residual projections keeps the residual stream's variance flat.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token plus position embeddings: the first layer of the chain."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.tok_emb(idx) + self.pos_emb(pos)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm_f(self.blocks(self.embed(idx))))

    def pipeline_layers(self) -> list[Layer]:
        """The chain a pipeline splits: embeddings, each block, the final norm, the head."""
        return [Layer("embed", ("tok_emb", "pos_emb"), CharTransformer.embed),
                *(module_layer(f"blocks.{i}") for i in range(len(self.blocks))),
                module_layer("norm_f"), module_layer("head")]


class CharLM(Task):
    """Next-character prediction; metric: held-out loss (nats/char) and bits per character."""

    name = "charlm"
    models = ("transformer",)
    default_model = "transformer"
    metric = "bpc"
    higher_is_better = False
    demo_strategy = DEMO_STRATEGY
    option_rules = {"seq_len": {"ge": 2, "le": 65536}, "min_length": {"ge": 1},
                    "seed": SEED_RULE, "test_fraction": {"gt": 0, "lt": 1},
                    "d_model": {"ge": 1, "le": 65536}, "n_layer": {"ge": 1, "le": 1024},
                    "n_head": {"ge": 1}, "dropout": {"ge": 0, "lt": 1},
                    "corpus": {"choices": CORPORA}, "corpus_chars": {"ge": 1000}}

    def __init__(
        self,
        seq_len: int = 64,
        variable_length: bool = False,
        min_length: int | None = None,
        seed: int = 0,
        test_fraction: float = 0.1,
        d_model: int = 128,
        n_layer: int = 2,
        n_head: int = 4,
        dropout: float = 0.0,
        tie_weights: bool = True,
        corpus: str = "topics",
        corpus_chars: int | None = None,
        cache_dir: str | os.PathLike | None = None,
    ):
        """`variable_length`: each training window keeps a random real length in
        `[min_length, seq_len]` (drawn once from `seed`), the rest is padding whose
        targets are `IGNORE_INDEX`; the test windows are always full.
        `corpus`: `topics` (small, the default) or `stdlib` (the standard library's
        sources, built once and cached in `cache_dir`); `corpus_chars`: at most that many
        characters of it, split as the whole is (a budget); `bigbatch.tasks.corpus`."""
        if seq_len < 2:
            raise ConfigError(f"seq_len={seq_len} is too small; allowed: >= 2")
        if not 0.0 < test_fraction < 1.0:
            raise ConfigError(f"test_fraction={test_fraction} is out of range; allowed: (0, 1)")
        if d_model % n_head:
            raise ConfigError(f"d_model={d_model} must be divisible by n_head={n_head}")
        data = load_corpus(corpus, test_fraction=test_fraction, max_chars=corpus_chars,
                           cache=cache_dir)
        for part, ids in (("training", data.train), ("held-out", data.test)):
            if ids.numel() <= seq_len:
                cap = "" if corpus_chars is None else f" with corpus_chars={corpus_chars}"
                raise ConfigError(f"corpus={corpus!r}{cap} leaves the {part} text "
                                  f"{ids.numel()} characters; allowed: more than "
                                  f"seq_len={seq_len} in each split")
        self.corpus = data
        self.cache_path, self.generated = data.cache_path, data.generated
        self.chars = data.chars
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.seq_len = seq_len
        self.model_options = dict(
            d_model=d_model, n_layer=n_layer, n_head=n_head, dropout=dropout,
            tie_weights=tie_weights,
        )
        x, y = _windows(data.train, seq_len)
        if variable_length:
            lo = seq_len // 4 if min_length is None else min_length
            if not 1 <= lo <= seq_len:
                raise ConfigError(f"min_length={lo} is out of range; allowed: [1, {seq_len}]")
            gen = torch.Generator().manual_seed(seed)
            lengths = torch.randint(lo, seq_len + 1, (len(x),), generator=gen)
            pad = torch.arange(seq_len)[None, :] >= lengths[:, None]
            x = x.masked_fill(pad, 0)
            y = y.masked_fill(pad, IGNORE_INDEX)
        self.train_set = TensorDataset(x, y)
        self.test_set = TensorDataset(*_windows(data.test, seq_len))

    def data_note(self) -> str:
        """The corpus's identity (Python version, files and their hash, cache)."""
        return self.corpus.line()

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids if i != IGNORE_INDEX)

    def build_model(self, name: str | None = None) -> nn.Module:
        self.check_model(name)
        return CharTransformer(self.vocab_size, self.seq_len, **self.model_options)

    def recipe(self, model: str | None = None) -> Recipe:
        return _RECIPES[self.check_model(model)]

    def tp_plan(self, model: nn.Module) -> dict[str, str]:
        """`TENSOR_PARALLEL_PLAN` (the same for every CharTransformer)."""
        return dict(TENSOR_PARALLEL_PLAN)

    def check_tensor_parallel(self, degree: int) -> None:
        d_model, n_head = self.model_options["d_model"], self.model_options["n_head"]
        if d_model % n_head:
            raise ConfigError(f"d_model={d_model} must be divisible by n_head={n_head}")
        # Whole heads per rank; then d_model and the MLP's 4*d_model divide as well.
        if n_head % degree:
            raise ConfigError(f"n_head={n_head} is not divisible by "
                              f"tensor_parallel_degree={degree}")

    def loss(self, output, batch):
        """Sum of cross-entropies and the count of real targets. `output` may be logits
        sharded on the vocabulary (a DTensor): then call it under `loss_parallel_if`."""
        y = batch[1]
        loss = F.cross_entropy(
            output.reshape(-1, output.shape[-1]), y.reshape(-1),
            ignore_index=IGNORE_INDEX, reduction="sum",
        )
        if type(loss) is not torch.Tensor:
            from bigbatch.parallel.tensor_parallel import loss_value

            loss = loss_value(loss)
        return loss, int((y != IGNORE_INDEX).sum())

    def evaluate(self, model, loader, reduce: Reduce | None = None) -> dict[str, float]:
        with _loss_parallel(model):
            sums = eval_sums(self, model, loader)
        if reduce is not None:
            sums = reduce(sums)
        loss = sums[0].item() / max(sums[1].item(), 1.0)
        return {"loss": loss, "bpc": loss / math.log(2)}


def _loss_parallel(model: nn.Module):
    # A tensor-parallel model means DTensor is imported; otherwise skip the import's cost.
    if "torch.distributed.tensor" not in sys.modules:
        return contextlib.nullcontext()
    from bigbatch.parallel.tensor_parallel import loss_parallel_if

    return loss_parallel_if(model)
