"""Qwen3.5 / Qwen3.6 presets: HF-style config dicts (what their ``config.json`` holds, the text
model's), with a tiny ``qwen3.5-debug`` for CPU tests."""

_COMMON = dict(
    model_type="qwen3_5_text",
    hidden_act="silu",
    head_dim=256,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    rms_norm_eps=1e-6,
    rope_parameters=dict(rope_type="default", rope_theta=10_000_000, partial_rotary_factor=0.25),
    attention_bias=False,
    vocab_size=248_320,
    max_position_embeddings=262_144,
    mtp_num_hidden_layers=1,  # the MTP layer, kept by conversion (models/qwen3_5/convert.py)
)


def _layer_types(num_layers: int, interval: int = 4) -> list[str]:
    """Three Gated DeltaNet layers, then a full-attention one."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


PRESETS: dict[str, dict] = {
    "qwen3.5-debug": dict(
        _COMMON,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        vocab_size=256,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        layer_types=_layer_types(4),
    ),
    "qwen3.5-0.8b": dict(
        _COMMON,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        tie_word_embeddings=True,
        layer_types=_layer_types(24),
    ),
    "qwen3.6-27b": dict(
        _COMMON,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        tie_word_embeddings=False,
        layer_types=_layer_types(64),
    ),
}
