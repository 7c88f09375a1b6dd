"""Qwen3.5 / Qwen3.6 MoE presets: the text model's fields of the published ``config.json``
(Qwen3.5-35B-A3B and Qwen3.6-35B-A3B have the same text model), with a tiny
``qwen3.5-moe-debug`` for CPU tests."""

from megatron_longstraw.models.qwen3_5.presets import PRESETS as _DENSE, _layer_types

_COMMON = dict(
    {k: v for k, v in _DENSE["qwen3.6-27b"].items() if k not in ("intermediate_size", "layer_types")},
    model_type="qwen3_5_moe_text",
    router_aux_loss_coef=0.001,  # (a pre-training loss; not used here)
)

_A3B = dict(
    _COMMON,
    hidden_size=2048,
    num_hidden_layers=40,
    num_attention_heads=16,
    num_key_value_heads=2,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    tie_word_embeddings=False,
    layer_types=_layer_types(40),
)

PRESETS: dict[str, dict] = {
    "qwen3.5-moe-debug": dict(
        _COMMON,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        vocab_size=256,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        layer_types=_layer_types(4),
    ),
    "qwen3.5-35b-a3b": _A3B,
    "qwen3.6-35b-a3b": dict(_A3B),
}
