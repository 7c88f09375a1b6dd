"""Pure-math pieces of the analytic FLOPs formulas that the families compose (for MFU).

FLOPs count model math only: 2 x weight elements per token for every linear layer of the
decoder, causal attention as ``2 * heads * (d_qk + d_v) * s^2 / 2`` per layer (a chunk at
offset ``o`` of length ``c`` costs ``2 * heads * (d_qk + d_v) * c * (o + c / 2)``), and Gated
DeltaNet's chunked delta rule as ``heads * (6 * d_k * d_v + 2 * 64 * (d_k + d_v))`` per token
(state read-out, update and the intra-chunk terms of the 64-token chunk form).
"""

import re

from megatron.core import parallel_state

_EXPERT_ID = re.compile(r"\.mlp\.experts\.(?:local_experts\.(\d+)\.|.*weight(\d+)$)")
DELTA_RULE_CHUNK = 64  # tokens per chunk of the chunked delta rule


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


def linear_flops(weight_elements: int, tokens: float) -> float:
    """FLOPs of ``tokens`` tokens through linear layers of ``weight_elements`` weights."""
    return 2.0 * weight_elements * tokens


def causal_attention_flops(heads: int, d_qk: int, d_v: int, offset: float, length: float) -> float:
    """FLOPs of one causal attention layer for ``length`` queries after ``offset`` earlier keys
    (scores and values: ``2 * heads * (d_qk + d_v)`` per visible query-key pair)."""
    return 2.0 * heads * (d_qk + d_v) * length * (offset + length / 2)


def delta_rule_flops(heads: int, d_k: int, d_v: int, tokens: float) -> float:
    """FLOPs of one Gated DeltaNet layer's chunked delta rule over ``tokens`` tokens."""
    return tokens * heads * (6 * d_k * d_v + 2 * DELTA_RULE_CHUNK * (d_k + d_v))


def logits_flops(hidden_size: int, vocab_size: int, positions: float) -> float:
    """FLOPs of the output layer's logits at ``positions`` positions."""
    return 2.0 * hidden_size * vocab_size * positions
