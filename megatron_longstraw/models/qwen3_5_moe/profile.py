"""What Qwen3.5-MoE costs: FLOPs (for MFU) and the budget planner's profile: Qwen3.5's
(``models/qwen3_5/profile.py``) with a MoE block in every layer. The routed experts' activation
bytes are ``models/profile.py``'s ``routed_experts_saved_bytes`` (measured on GLM-5's MoE);
the shared expert is a SwiGLU MLP whose output a sigmoid gate scales (its input and the gate's
bf16 score kept: ``2 hidden + 2`` bytes more)."""

from megatron_longstraw.models.flops import active_linear_weight_elements
from megatron_longstraw.models.profile import (ModelProfile, moe_capture_transient_bytes, routed_experts_saved_bytes,
                                               swiglu_mlp_saved_bytes)
from megatron_longstraw.models.qwen3_5.profile import MlpProfile, capture_flops, hybrid_profile, response_flops
from megatron_longstraw.models.qwen3_5_moe.config import normalize_hf_config


def prompt_flops(hf: dict, model, prompt_length: int) -> float:
    """Forward FLOPs of capturing a ``prompt_length`` prompt on ``model`` (routed experts counted
    as ``num_experts_per_tok`` experts per token)."""
    return capture_flops(hf, active_linear_weight_elements(model, hf["num_experts_per_tok"]), prompt_length)


def response_forward_flops(hf: dict, model, prompt_length: int, response_tokens: int) -> float:
    """Forward FLOPs of one response of ``response_tokens`` tokens after a ``prompt_length`` prompt."""
    return response_flops(hf, active_linear_weight_elements(model, hf["num_experts_per_tok"]), prompt_length,
                          response_tokens)


def moe_mlp(hf: dict) -> MlpProfile:
    """The MoE block: router ``[experts, hidden]`` (replicated over TP), routed SwiGLU experts,
    the gated shared expert."""
    hidden, experts, topk = hf["hidden_size"], hf["num_experts"], hf["num_experts_per_tok"]
    ffn, shared = hf["moe_intermediate_size"], hf["shared_expert_intermediate_size"]
    router, routed, shared_expert = experts * hidden, experts * 3 * ffn * hidden, 3 * shared * hidden + hidden
    return MlpProfile(
        params=router + routed + shared_expert, expert_params=routed, replicated_params=router + hidden,
        active_params=router + shared_expert + topk * 3 * ffn * hidden,
        saved_bytes=(routed_experts_saved_bytes(hidden, experts, topk, ffn)
                     + swiglu_mlp_saved_bytes(hidden, shared) + 2 * hidden + 2),
        routed_hidden_bytes=2 * hidden * topk, capture_transient_bytes=moe_capture_transient_bytes(hidden, topk),
        num_experts=experts, moe=True)


def plan_profile(hf: dict) -> ModelProfile:
    """The budget planner's description of a Qwen3.5-MoE config, from the raw config alone.
    ``ValueError`` for an invalid config."""
    hf = normalize_hf_config(hf)
    return hybrid_profile(hf, moe_mlp(hf), (hf["moe_intermediate_size"], hf["shared_expert_intermediate_size"]))
