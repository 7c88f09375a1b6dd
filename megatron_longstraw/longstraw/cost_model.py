"""Analytic FLOPs (for MFU) and the memory floor of a LongStraw step.

FLOPs count model math only: 2 x weight elements per token for every linear layer of the
decoder, causal attention as ``2 * heads * (d_qk + d_v) * s^2 / 2`` per layer (a chunk at
offset ``o`` of length ``c`` costs ``2 * heads * (d_qk + d_v) * c * (o + c / 2)``), and Gated
DeltaNet's chunked delta rule as ``heads * (6 * d_k * d_v + 2 * 64 * (d_k + d_v))`` per token
(state read-out, update and the intra-chunk terms of the 64-token chunk form).
"""

import re

from megatron.core import parallel_state

_EXPERT_ID = re.compile(r"\.mlp\.experts\.(?:local_experts\.(\d+)\.|.*weight(\d+)$)")


def linear_weight_elements(model) -> int:
    """Weight elements of the decoder's linear layers over all TP ranks (embedding and output
    layer excluded; every decoder weight matrix here is TP-sharded or, for norms, 1-D)."""
    local = sum(p.numel() for n, p in model.named_parameters() if n.startswith("decoder.") and p.dim() == 2)
    return local * parallel_state.get_tensor_model_parallel_world_size()


def active_linear_weight_elements(model, experts_per_token: int) -> int:
    """Decoder linear weight elements one token passes through, over all TP ranks: like
    ``linear_weight_elements`` but each MoE layer's routed experts counted as
    ``experts_per_token`` experts (every expert has the same shape)."""
    dense, experts = 0, {}
    for name, p in model.named_parameters():
        if not name.startswith("decoder.") or p.dim() != 2:
            continue
        match = _EXPERT_ID.search(name)
        if match is None:
            dense += p.numel()
            continue
        layer = name[:match.start()]
        elements, ids = experts.setdefault(layer, [0, set()])
        experts[layer] = [elements + p.numel(), ids | {match.group(1) or match.group(2)}]
    routed = sum(elements // len(ids) * experts_per_token for elements, ids in experts.values())
    return (dense + routed) * parallel_state.get_tensor_model_parallel_world_size()


def glm_prompt_flops(hf: dict, active_linear_elements: int, prompt_length: int) -> float:
    """Forward FLOPs of capturing a GLM-5 prompt: active linear weights (``active_linear_weight_
    elements``), the DSA indexer's scores on layers with their own indexer (``2 * heads * d`` per
    visible query-key pair), absorbed sparse MLA over ``min(index_topk, position + 1)`` keys per
    query (scores over ``kv_lora_rank + rope``, values over ``kv_lora_rank``), last logits."""
    p = float(prompt_length)
    k = min(float(hf["index_topk"]), p)
    flops = 2.0 * active_linear_elements * p
    own_indexers = hf["indexer_types"].count("full")
    flops += own_indexers * 2.0 * hf["index_n_heads"] * hf["index_head_dim"] * p * (p + 1) / 2
    keys_attended = k * p - k * (k - 1) / 2  # sum over positions of min(k, position + 1)
    latent = hf["kv_lora_rank"] + hf["qk_rope_head_dim"]
    flops += hf["num_hidden_layers"] * hf["num_attention_heads"] * 2.0 * (latent + hf["kv_lora_rank"]) * keys_attended
    flops += 2.0 * hf["hidden_size"] * hf["vocab_size"]
    return flops


def prompt_flops(hf: dict, model, prompt_length: int) -> float | None:
    """Capture FLOPs of the model's family (``None`` for a family without a formula)."""
    if hf["model_type"].startswith("qwen3_5"):
        return qwen_prompt_flops(hf, linear_weight_elements(model), prompt_length)
    if hf["model_type"] == "glm_moe_dsa":
        return glm_prompt_flops(hf, active_linear_weight_elements(model, hf["num_experts_per_tok"]), prompt_length)
    return None


def qwen_prompt_flops(hf: dict, linear_elements: int, prompt_length: int) -> float:
    """Forward FLOPs of capturing a Qwen3.5 prompt (logits of the last position only)."""
    p = float(prompt_length)
    flops = 2.0 * linear_elements * p
    n_attn = hf["layer_types"].count("full_attention")
    n_gdn = hf["layer_types"].count("linear_attention")
    flops += n_attn * 2.0 * hf["num_attention_heads"] * (2 * hf["head_dim"]) * p * p / 2
    dk, dv = hf["linear_key_head_dim"], hf["linear_value_head_dim"]
    flops += n_gdn * p * hf["linear_num_value_heads"] * (6 * dk * dv + 2 * 64 * (dk + dv))
    flops += 2.0 * hf["hidden_size"] * hf["vocab_size"]  # the last position's logits
    return flops


def memory_floor_bytes(n_params: int, param_bytes: int, optimizer_bytes_per_param: int,
                       prompt_state_bytes: int, response_activation_bytes: int) -> int:
    """Parameters + gradients + optimizer states + prompt state + one response's activations."""
    return (n_params * (2 * param_bytes + optimizer_bytes_per_param)
            + prompt_state_bytes + response_activation_bytes)



def qwen_response_forward_flops(hf: dict, linear_elements: int, prompt_length: int, response_tokens: int) -> float:
    """Forward FLOPs of ``response_tokens`` tokens of one response after a Qwen3.5 prompt: linear
    layers, attention over the prompt plus the causal response part, Gated DeltaNet, logits."""
    r, p = float(response_tokens), float(prompt_length)
    flops = 2.0 * linear_elements * r
    n_attn = hf["layer_types"].count("full_attention")
    n_gdn = hf["layer_types"].count("linear_attention")
    flops += n_attn * 2.0 * hf["num_attention_heads"] * (2 * hf["head_dim"]) * r * (p + r / 2)
    dk, dv = hf["linear_key_head_dim"], hf["linear_value_head_dim"]
    flops += n_gdn * r * hf["linear_num_value_heads"] * (6 * dk * dv + 2 * 64 * (dk + dv))
    flops += 2.0 * hf["hidden_size"] * hf["vocab_size"] * r
    return flops
