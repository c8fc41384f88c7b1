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

Each also names its block class for ZeRO-3 (already found through ``nn.ModuleList``).
Pass ``prefix`` when the model sits under another name.
"""

from __future__ import annotations

from bigbatch.parallel.model_plan import ModelPlan

__all__ = ["gpt2_plan", "llama_plan"]


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
