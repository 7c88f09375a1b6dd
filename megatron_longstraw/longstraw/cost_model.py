"""Analytic FLOPs (for MFU) and the memory floor of a LongStraw step.

FLOPs count model math only: 2 x weight elements per token for every linear layer of the
decoder, causal attention as ``2 * heads * (d_qk + d_v) * s^2 / 2`` per layer (a chunk at
offset ``o`` of length ``c`` costs ``2 * heads * (d_qk + d_v) * c * (o + c / 2)``), and Gated
DeltaNet's chunked delta rule as ``heads * (6 * d_k * d_v + 2 * 64 * (d_k + d_v))`` per token
(state read-out, update and the intra-chunk terms of the 64-token chunk form).
"""

from megatron.core import parallel_state


def linear_weight_elements(model) -> int:
    """Weight elements of the decoder's linear layers over all TP ranks (embedding and output
    layer excluded; every decoder weight matrix here is TP-sharded or, for norms, 1-D)."""
    local = sum(p.numel() for n, p in model.named_parameters() if n.startswith("decoder.") and p.dim() == 2)
    return local * parallel_state.get_tensor_model_parallel_world_size()


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
