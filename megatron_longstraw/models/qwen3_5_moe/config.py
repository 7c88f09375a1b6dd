"""Qwen3.5 / Qwen3.6 MoE family (HF ``qwen3_5_moe`` / ``qwen3_5_moe_text``): the config, its
checks and Megatron's ``TransformerConfig`` for it.

The stack is Qwen3.5's (``models/qwen3_5/config.py``: Gated DeltaNet and gated attention per
``layer_types``, zero-centred norms); every layer's MLP is Megatron's ``MoELayer`` as HF's
``Qwen3_5MoeSparseMoeBlock`` computes it:

- router: ``softmax`` over all ``num_experts`` logits, top ``num_experts_per_tok``, renormalized.
  Megatron's softmax router without ``moe_router_pre_softmax`` takes the top-k of the logits and
  a softmax over those, the same weights (a softmax over a subset is the renormalized full
  softmax); no expert bias, no grouping; router math in fp32 (fp64 for fp64 parameters).
- experts: SwiGLU of ``moe_intermediate_size``, HF ``gate_up_proj[e]`` = Megatron's fused
  ``linear_fc1`` of ``SequentialMLP`` expert ``e``.
- shared expert: a SwiGLU of ``shared_expert_intermediate_size`` times
  ``sigmoid(shared_expert_gate(x))``: Megatron's ``SharedExpertMLP`` with
  ``moe_shared_expert_gate`` (its ``gate_weight`` is HF's ``[1, hidden]`` gate).
- auxiliary losses: none (``router_aux_loss_coef`` is a pre-training loss; GRPO's loss is the
  policy's).
"""

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.qwen3_5 import config as hybrid
from megatron_longstraw.models.qwen3_5.config import (HYBRID_REQUIRED, check_hybrid_layers, flatten_hf_config,
                                                      hybrid_config_kwargs)
from megatron_longstraw.models.rope import check_rope_type

MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
NAME = "Qwen3.5-MoE"

_REQUIRED = HYBRID_REQUIRED + ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                               "shared_expert_intermediate_size")

def normalize_hf_config(hf: dict) -> dict:
    """Flatten a ``qwen3_5_moe`` (multimodal) config to its ``text_config`` and validate it."""
    hf = check_hybrid_layers(flatten_hf_config(hf, "qwen3_5_moe", "qwen3_5_moe_text"), _REQUIRED, NAME)
    where = hf.get("_source", "config")
    if not 1 <= hf["num_experts_per_tok"] <= hf["num_experts"]:
        raise ValueError(f"{where}: num_experts_per_tok ({hf['num_experts_per_tok']}) must be between 1 and "
                         f"num_experts ({hf['num_experts']})")
    for field in ("mlp_only_layers", "decoder_sparse_step"):  # (Qwen3-MoE's; every Qwen3.5-MoE layer is sparse)
        value = hf.get(field)
        if value not in (None, [], 1):
            raise ValueError(f"{where}: {field} {value!r} is not supported for {NAME} (every layer is MoE)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
    return hf


def transformer_config(hf: dict, options: ModelOptions) -> TransformerConfig:
    """Megatron ``TransformerConfig`` for a normalized Qwen3.5-MoE config: the hybrid stack, a
    ``MoELayer`` in every layer (module doc)."""
    kwargs = hybrid_config_kwargs(hf, options, ("moe_intermediate_size", "shared_expert_intermediate_size"))
    ep = kwargs["expert_model_parallel_size"]
    if kwargs["tensor_model_parallel_size"] > 1 and not kwargs["sequence_parallel"]:
        raise ValueError(f"{NAME} (Megatron's MoE) needs --sequence-parallel when --tensor-model-parallel-size > 1")
    if hf["num_experts"] % ep:
        raise ValueError(f"num_experts ({hf['num_experts']}) is not divisible by --expert-model-parallel-size {ep}")
    return TransformerConfig(
        **kwargs,
        ffn_hidden_size=hf["moe_intermediate_size"],  # (no dense MLP: every layer is MoE)
        num_moe_experts=hf["num_experts"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_router_topk=hf["num_experts_per_tok"],
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,
        moe_router_dtype="fp64" if kwargs["params_dtype"] == torch.float64 else "fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
        moe_shared_expert_gate=True,
        moe_token_dispatcher_type="alltoall" if ep > 1 else "allgather",
        moe_grouped_gemm=False,
    )


def gpt_model_kwargs(hf: dict) -> dict:
    """Qwen3.5's ``GPTModel`` keywords (vocabulary, RoPE, tying); a RoPE type it does not take is
    named for this family."""
    check_rope_type(hf, NAME)
    return hybrid.gpt_model_kwargs(hf)
