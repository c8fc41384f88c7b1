"""Small models written the way Hugging Face writes them, for the parallel tests.

- `Llama`: ``model.embed_tokens -> model.layers (ModuleList) -> model.norm``, an untied
  ``lm_head``, rotary embeddings computed once by the model and passed to every layer,
  q/k/v/o and gate/up/down projections, heads viewed with ``-1`` (as HF does), so
  column-parallel projections work on local heads.
- `GPT2`: ``transformer.wte/wpe -> transformer.h (ModuleList) -> transformer.ln_f`` and an
  untied ``lm_head``; its projections are HF's ``Conv1D`` (weight stored transposed,
  ``(in, out)``).

Nothing here is bigbatch's but the ready plans: the models stand in for a user's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bigbatch.engine.plans import bert_plan, gpt2_plan, llama_plan

VOCAB, D, HEADS, FFN, LAYERS, SEQ = 64, 32, 4, 64, 3, 8


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotary(seq: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(seq).float(), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = D // HEADS
        self.q_proj = nn.Linear(D, D, bias=False)
        self.k_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, D, bias=False)
        self.o_proj = nn.Linear(D, D, bias=False)

    def forward(self, x, position_embeddings):
        b, t, _ = x.shape
        shape = (b, t, -1, self.head_dim)
        q, k, v = (p(x).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj,
                                                               self.v_proj))
        cos, sin = position_embeddings
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class LlamaMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(D, FFN, bias=False)
        self.up_proj = nn.Linear(D, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(D)
        self.self_attn = LlamaAttention()
        self.post_attention_layernorm = RMSNorm(D)
        self.mlp = LlamaMLP()

    def forward(self, x, position_embeddings):
        x = x + self.self_attn(self.input_layernorm(x), position_embeddings)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(LlamaDecoderLayer() for _ in range(LAYERS))
        self.norm = RMSNorm(D)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        pos = rotary(ids.shape[1], D // HEADS)
        for layer in self.layers:
            x = layer(x, pos)
        return self.norm(x)


class Llama(nn.Module):
    """``LlamaForCausalLM``'s layout: ``model`` and an untied ``lm_head``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = LlamaModel()
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids):
        return self.lm_head(self.model(ids))


class Conv1D(nn.Module):
    """HF's GPT-2 projection: ``x @ weight + bias`` with ``weight`` of shape (in, out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight).view(
            *x.shape[:-1], self.nf)


class GPT2Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = Conv1D(3 * D, D)
        self.c_proj = Conv1D(D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).split(D, dim=-1)
        q, k, v = (z.view(b, t, HEADS, -1).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(a.transpose(1, 2).reshape(b, t, D))


class GPT2MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = Conv1D(FFN, D)
        self.c_proj = Conv1D(D, FFN)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(D)
        self.attn = GPT2Attention()
        self.ln_2 = nn.LayerNorm(D)
        self.mlp = GPT2MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.wpe = nn.Embedding(SEQ, D)
        self.h = nn.ModuleList(GPT2Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2(nn.Module):
    """``GPT2LMHeadModel``'s layout with the head untied."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = GPT2Model()
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids):
        return self.lm_head(self.transformer(ids))


class BertSelfAttention(nn.Module):
    """HF's BERT self-attention: heads viewed by a fixed count (``num_attention_heads``),
    which a tensor-parallel layout must divide by the degree (`bert_plan` does)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_attention_heads, self.attention_head_size = HEADS, D // HEADS
        self.all_head_size = D
        self.query, self.key, self.value = (nn.Linear(D, D) for _ in range(3))

    def forward(self, x):
        b, t, _ = x.shape
        shape = (b, t, self.num_attention_heads, self.attention_head_size)
        q, k, v = (m(x).view(shape).transpose(1, 2) for m in (self.query, self.key, self.value))
        a = F.scaled_dot_product_attention(q, k, v)
        return a.transpose(1, 2).reshape(b, t, self.all_head_size)


class BertLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.Module()
        self.attention.self = BertSelfAttention()
        self.attention.output = nn.Module()
        self.attention.output.dense = nn.Linear(D, D)
        self.attention.output.LayerNorm = nn.LayerNorm(D)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(D, FFN)
        self.output = nn.Module()
        self.output.dense = nn.Linear(FFN, D)
        self.output.LayerNorm = nn.LayerNorm(D)

    def forward(self, x):
        a = self.attention.output.dense(self.attention.self(x))
        x = self.attention.output.LayerNorm(x + a)
        h = self.output.dense(F.gelu(self.intermediate.dense(x)))
        return self.output.LayerNorm(x + h)


class Bert(nn.Module):
    """``BertForMaskedLM``'s names (``bert.embeddings``, ``bert.encoder.layer``) with an
    untied prediction head; trained here as a plain per-token classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.bert = nn.Module()
        self.bert.embeddings = nn.Module()
        self.bert.embeddings.word_embeddings = nn.Embedding(VOCAB, D)
        self.bert.embeddings.position_embeddings = nn.Embedding(SEQ, D)
        self.bert.embeddings.LayerNorm = nn.LayerNorm(D)
        self.bert.encoder = nn.Module()
        self.bert.encoder.layer = nn.ModuleList(BertLayer() for _ in range(LAYERS))
        self.decoder = nn.Linear(D, VOCAB)

    def forward(self, ids):
        e = self.bert.embeddings
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = e.LayerNorm(e.word_embeddings(ids) + e.position_embeddings(pos))
        for layer in self.bert.encoder.layer:
            x = layer(x)
        return self.decoder(x)


#: The ready plans, with HF's module names (`bigbatch.engine.plans`).
LLAMA_TP_PLAN = llama_plan().tp_plan
GPT2_TP_PLAN = gpt2_plan().tp_plan
BERT_PLAN = bert_plan(head="decoder")


def llama_layers(model: Llama) -> list:
    """The pipeline chain a Llama user writes: rotary cos/sin made on each block's stage."""
    from bigbatch.parallel.pipeline import decoder_layers

    return decoder_layers(model, embed="model.embed_tokens", blocks="model.layers",
                          norm="model.norm", head="lm_head",
                          block_args=lambda x: (rotary(x.shape[1], D // HEADS),))


def gpt2_layers(model: GPT2) -> list:
    """GPT-2's: token plus position embeddings, then the blocks, ``ln_f`` and the head."""
    from bigbatch.parallel.pipeline import decoder_layers

    def embed(m, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        return m.transformer.wte(ids) + m.transformer.wpe(pos)

    return decoder_layers(model, embed=("transformer.wte", "transformer.wpe"), embed_run=embed,
                          blocks="transformer.h", norm="transformer.ln_f", head="lm_head")


def make(name: str) -> nn.Module:
    torch.manual_seed(0)
    return {"llama": Llama, "gpt2": GPT2, "bert": Bert}[name]()


def token_batches(steps: int, batch: int, seq: int = SEQ, seed: int = 5) -> torch.Tensor:
    """`steps` batches of `batch` random token rows of `seq + 1` (inputs and shifted targets)."""
    return torch.randint(0, VOCAB, (steps, batch, seq + 1),
                         generator=torch.Generator().manual_seed(seed))


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state dict with every DTensor gathered whole, detached copies."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}
