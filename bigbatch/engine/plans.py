"""Ready model plans for the families users bring, with Hugging Face's module names.

    run = bigbatch.prepare(LlamaForCausalLM(config), strategy, total_steps,
                           model_plan=llama_plan())

- `llama_plan()`: Llama, Mistral, Qwen2 and the like (``model.layers.*``): q/k/v and
  gate/up column-parallel, o and down row-parallel, the embedding and an untied
  ``lm_head`` split by vocabulary (its logits stay sharded for ``loss_parallel``).
  The attention must view heads with ``-1`` (HF's does), so each rank keeps its heads.
- `gpt2_plan()`: GPT-2 (``transformer.h.*``, HF's ``Conv1D`` with weights stored
  ``(in, out)``): the MLP split column- then row-wise, the token embedding and head by
  vocabulary. Its attention stays whole: ``c_attn`` holds q, k and v in one output, and a
  column split would cut across the three.

- `bert_plan()`: BERT (``bert.encoder.layer.*``): query/key/value and the
  intermediate layer column-parallel, the attention output and the output layer
  row-parallel, the word embedding and the prediction head by vocabulary. HF's BERT
  views its heads by a fixed count, so the plan's own `parallelize` divides each
  self-attention's ``num_attention_heads`` and ``all_head_size`` by the tensor degree
  before laying out.

Each also names its block class for ZeRO-3 (already found through ``nn.ModuleList``).
Pass ``prefix`` when the model sits under another name.
"""

from __future__ import annotations

from bigbatch.engine.parallelize import parallelize
from bigbatch.errors import ConfigError
from bigbatch.parallel.model_plan import ModelPlan

__all__ = ["bert_plan", "gpt2_plan", "llama_plan"]


def llama_plan(prefix: str = "model", head: str = "lm_head") -> ModelPlan:
    """Megatron's split of a Llama-shaped decoder under `prefix` (HF names)."""
    layer = f"{prefix}.layers.*"
    tp = {f"{prefix}.embed_tokens": "vocab_embedding"}
    tp.update({f"{layer}.self_attn.{p}_proj": "colwise" for p in "qkv"})
    tp[f"{layer}.self_attn.o_proj"] = "rowwise"
    tp.update({f"{layer}.mlp.{p}_proj": "colwise" for p in ("gate", "up")})
    tp[f"{layer}.mlp.down_proj"] = "rowwise"
    tp[head] = "vocab_head"
    return ModelPlan(blocks=("LlamaDecoderLayer",), tp_plan=tp)


def gpt2_plan(prefix: str = "transformer", head: str = "lm_head") -> ModelPlan:
    """GPT-2's MLP (``Conv1D``) split over the tensor ranks, embedding and head by
    vocabulary (HF names); the fused q/k/v attention stays whole."""
    tp = {f"{prefix}.wte": "vocab_embedding",
          f"{prefix}.h.*.mlp.c_fc": "conv1d_colwise",
          f"{prefix}.h.*.mlp.c_proj": "conv1d_rowwise",
          head: "vocab_head"}
    return ModelPlan(blocks=("GPT2Block",), tp_plan=tp)


def bert_plan(prefix: str = "bert", head: str = "cls.predictions.decoder") -> ModelPlan:
    """Megatron's split of a BERT encoder under `prefix` (HF names); its `parallelize`
    gives each self-attention its local head count first."""
    layer = f"{prefix}.encoder.layer.*"
    tp = {f"{prefix}.embeddings.word_embeddings": "vocab_embedding"}
    tp.update({f"{layer}.attention.self.{p}": "colwise" for p in ("query", "key", "value")})
    tp[f"{layer}.attention.output.dense"] = "rowwise"
    tp[f"{layer}.intermediate.dense"] = "colwise"
    tp[f"{layer}.output.dense"] = "rowwise"
    tp[head] = "vocab_head"
    return ModelPlan(blocks=("BertLayer",), tp_plan=tp, parallelize=_local_heads_first)


def _local_heads_first(module, mesh, strategy, plan, **kw) -> bool:
    degree = mesh.degrees.tensor
    if degree > 1:
        for name, m in module.named_modules():
            heads = getattr(m, "num_attention_heads", None)
            if isinstance(heads, int) and hasattr(m, "all_head_size"):
                if heads % degree:
                    raise ConfigError(f"bert_plan: {name} has {heads} attention heads, not "
                                      f"divisible by tensor_parallel_degree={degree}")
                m.num_attention_heads, m.all_head_size = heads // degree, m.all_head_size // degree
    return parallelize(module, mesh, strategy, plan, **kw)
