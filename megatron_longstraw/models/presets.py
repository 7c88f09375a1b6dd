"""Named model presets (Megatron-style names), each an HF-style config dict.

A preset is exactly what a ``config.json`` would hold, so presets, HF folders and the
``transformers`` reference models all go through one path (``resolve_hf_config``). Every
family has a tiny ``*-debug`` size for CPU tests.
"""

import copy

from megatron_longstraw.models.hf_config import read_config_json

_QWEN3_5_COMMON = dict(
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
)


def _qwen_layer_types(num_layers: int, interval: int = 4) -> list[str]:
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(num_layers)
    ]


_GLM5_COMMON = dict(
    # HF GlmMoeDsaConfig defaults (they describe GLM-5)
    model_type="glm_moe_dsa",
    hidden_act="silu",
    q_lora_rank=2048,
    kv_lora_rank=512,
    qk_nope_head_dim=192,
    qk_rope_head_dim=64,
    v_head_dim=256,
    index_topk=2048,
    index_head_dim=128,
    index_n_heads=32,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rms_norm_eps=1e-5,
    attention_bias=False,
    vocab_size=154_880,
    max_position_embeddings=202_752,
    # not verified against zai-org/GLM-5's config.json (HF's fallback would be 10000)
    rope_parameters=dict(rope_type="default", rope_theta=1_000_000),
    tie_word_embeddings=False,
)


def _glm5_layer_types(num_layers: int, first_dense: int) -> dict:
    return dict(
        num_hidden_layers=num_layers,
        first_k_dense_replace=first_dense,
        mlp_layer_types=["dense"] * first_dense + ["sparse"] * (num_layers - first_dense),
        indexer_types=["full"] * num_layers,
    )


PRESETS: dict[str, dict] = {
    "qwen3.5-debug": dict(
        _QWEN3_5_COMMON,
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
        layer_types=_qwen_layer_types(4),
    ),
    "qwen3.5-0.8b": dict(
        _QWEN3_5_COMMON,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        tie_word_embeddings=True,
        layer_types=_qwen_layer_types(24),
    ),
    "qwen3.6-27b": dict(
        _QWEN3_5_COMMON,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        tie_word_embeddings=False,
        layer_types=_qwen_layer_types(64),
    ),
    # tiny GLM-5 for CPU tests: dense + MoE layers, 16 experts in 4 groups (2 groups kept,
    # 4 active), top-8 DSA (sequences of 32+ tokens drop keys), full and shared indexer layers
    # (index_topk_freq=2, index_skip_topk_offset=2 in HF terms)
    "glm-5-debug": dict(
        _GLM5_COMMON,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        indexer_types=["full", "full", "shared", "full"],
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        index_topk=8,
        index_head_dim=16,
        index_n_heads=4,
        vocab_size=256,
        max_position_embeddings=4096,
        rope_parameters=dict(rope_type="default", rope_theta=10_000),
    ),
    "glm-5": dict(
        _GLM5_COMMON,
        **_glm5_layer_types(78, 3),
        hidden_size=6144,
        intermediate_size=12_288,
        moe_intermediate_size=2048,
        num_attention_heads=64,
        num_key_value_heads=64,
        n_routed_experts=256,
        num_experts_per_tok=8,
    ),
    # GLM-5 head dims, latents and DSA sizes with fewer/narrower layers and experts: ~3B
    # parameters, so bf16 weights + grads + fp32 Adam fit one 141 GB H200 for long-context runs
    "glm-5-mini": dict(
        _GLM5_COMMON,
        **_glm5_layer_types(12, 3),
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=1024,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_routed_experts=32,
        num_experts_per_tok=8,
    ),
}


def preset_names() -> list[str]:
    """All preset names."""
    return sorted(PRESETS)


def resolve_hf_config(model: str) -> dict:
    """A preset name, an HF folder, or a ``config.json`` path -> a fresh config dict."""
    if model in PRESETS:
        config = copy.deepcopy(PRESETS[model])
        config["_source"] = f"preset {model}"
        return config
    if "/" in model or model.endswith(".json"):
        return read_config_json(model)
    raise ValueError(
        f"--model {model!r} is neither a preset ({', '.join(preset_names())}) nor a path"
    )


# per-layer pattern fields of the HF configs (one entry per decoder layer)
_LAYER_LISTS = ("layer_types", "mlp_layer_types", "indexer_types")


def with_num_layers(hf: dict, num_layers: int) -> dict:
    """A copy of ``hf`` keeping its first ``num_layers`` decoder layers (per-layer patterns cut
    to match): the same widths at a reduced depth, for runs scaled to fewer GPUs."""
    total = hf["num_hidden_layers"]
    if not 1 <= num_layers <= total:
        raise ValueError(f"--num-layers must be in [1, {total}] for this model, got {num_layers}")
    config = copy.deepcopy(hf)
    config["num_hidden_layers"] = num_layers
    for field in _LAYER_LISTS:
        if field in config:
            config[field] = config[field][:num_layers]
    if "first_k_dense_replace" in config:
        config["first_k_dense_replace"] = min(config["first_k_dense_replace"], num_layers)
    return config
