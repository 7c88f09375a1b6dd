"""GLM-5 presets: HF-style config dicts (what their ``config.json`` holds), with a tiny
``glm-5-debug`` for CPU tests and ``glm-5-mini`` (GLM-5's head dims, latents and DSA sizes at ~3B
parameters) for long-context runs on one GPU."""

_COMMON = dict(
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
    rope_parameters=dict(rope_type="default", rope_theta=1_000_000),
    tie_word_embeddings=False,
    num_nextn_predict_layers=1,  # the MTP layer, kept by conversion (models/glm5/convert.py)
)


def _layer_types(num_layers: int, first_dense: int) -> dict:
    """``first_dense`` dense MLP layers, then MoE; every layer with its own DSA indexer."""
    return dict(
        num_hidden_layers=num_layers,
        first_k_dense_replace=first_dense,
        mlp_layer_types=["dense"] * first_dense + ["sparse"] * (num_layers - first_dense),
        indexer_types=["full"] * num_layers,
    )


PRESETS: dict[str, dict] = {
    # tiny GLM-5 for CPU tests: dense + MoE layers, 16 experts in 4 groups (2 groups kept,
    # 4 active), top-8 DSA (sequences of 32+ tokens drop keys), full and shared indexer layers
    # (index_topk_freq=2, index_skip_topk_offset=2 in HF terms)
    "glm-5-debug": dict(
        _COMMON,
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
        _COMMON,
        **_layer_types(78, 3),
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
        _COMMON,
        **_layer_types(12, 3),
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=1024,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_routed_experts=32,
        num_experts_per_tok=8,
    ),
}
