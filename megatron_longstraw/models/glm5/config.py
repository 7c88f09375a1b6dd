"""GLM-5 family (HF ``glm_moe_dsa``): the config, its checks and Megatron's
``MLATransformerConfig`` and ``GPTModel`` settings for it (how HF semantics map onto Megatron's:
the package's module doc)."""

import torch
from megatron.core.transformer.experimental_attention_variant.dsa import is_dsa_skip_topk_layer
from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron_longstraw.models.hf_config import get, require, rope_parameters
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.rope import check_rope_type, mla_yarn_kwargs

MODEL_TYPES = ("glm_moe_dsa",)
NAME = "GLM-5"

_REQUIRED = (
    "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "n_routed_experts", "num_experts_per_tok", "vocab_size",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "index_topk", "index_head_dim", "index_n_heads", "indexer_types", "mlp_layer_types",
)
HF_LATENT_NORM_EPS = 1e-6  # HF builds q_a_layernorm / kv_a_layernorm with the class default eps
HF_INDEXER_NORM_EPS = 1e-6  # HF's indexer k_norm is nn.LayerNorm(index_head_dim, eps=1e-6)


def _fail(hf: dict, message: str):
    raise ValueError(f"{hf.get('_source', 'config')}: {message}")


def normalize_hf_config(hf: dict) -> dict:
    """Fill HF's derived fields (``indexer_types``, ``mlp_layer_types``) as HF does; validate."""
    hf = dict(hf)
    for alias in ("num_local_experts", "num_experts"):
        if hf.get("n_routed_experts") is None and hf.get(alias) is not None:
            hf["n_routed_experts"] = hf[alias]
    layers = hf.get("num_hidden_layers")
    if hf.get("indexer_types") is None and layers:
        pattern = hf.get("index_topk_pattern")
        if pattern is not None:
            hf["indexer_types"] = ([{"F": "full", "S": "shared"}[c] for c in pattern]
                                   if isinstance(pattern, str) else list(pattern))
        else:  # HF GlmMoeDsaConfig.__post_init__
            freq = max(get(hf, "index_topk_freq", 1), 1)
            offset = get(hf, "index_skip_topk_offset", 2)
            hf["indexer_types"] = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                                   for i in range(layers)]
    if hf.get("mlp_layer_types") is None and layers:
        dense = min(get(hf, "first_k_dense_replace", 3), layers)
        hf["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (layers - dense)
    require(hf, _REQUIRED, NAME)
    for field, allowed in (("indexer_types", ("full", "shared")), ("mlp_layer_types", ("dense", "sparse"))):
        values = hf[field]
        if len(values) != layers or any(v not in allowed for v in values):
            _fail(hf, f"{field} must list {layers} entries from {allowed}, got {list(values)[:8]}...")
    if hf["indexer_types"][0] != "full":
        _fail(hf, "indexer_types[0] must be 'full' (a shared layer needs an earlier full layer)")
    return hf


def _indexer_share_schedule(hf: dict) -> tuple[int, int]:
    """``(dsa_indexer_topk_freq, dsa_indexer_skip_topk_offset)`` reproducing ``indexer_types``."""
    types = hf["indexer_types"]
    layers = len(types)
    if all(t == "full" for t in types):
        return 1, 0
    for freq in range(2, layers + 1):
        for offset in range(1, layers + 1):
            pattern = ["shared" if is_dsa_skip_topk_layer(i + 1, offset, freq) else "full"
                       for i in range(layers)]
            if pattern == list(types):
                return freq, offset
    _fail(hf, "indexer_types is not a periodic full/shared pattern (index_topk_freq / "
              "index_skip_topk_offset); Megatron's DSA top-k sharing cannot express it")


def _check_divisible(value: int, what: str, size: int, flag: str) -> None:
    if value % size:
        raise ValueError(f"{what} ({value}) is not divisible by {flag} {size}")


def _rope_kwargs(hf: dict) -> dict:
    rope = rope_parameters(hf)
    rope_type = check_rope_type(hf, NAME)
    theta = get(rope, "rope_theta", 10_000.0)
    if get(rope, "partial_rotary_factor", 1.0) != 1.0:
        _fail(hf, "partial_rotary_factor != 1 is not supported for GLM-5 (RoPE covers qk_rope_head_dim)")
    if rope_type == "default":
        # rotary_scaling_factor / mscale_all_dim make Megatron's softmax mscale exactly 1.0
        return dict(rope_type="rope", rotary_base=theta, rotary_percent=1.0,
                    rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    return mla_yarn_kwargs(hf)  # Megatron's YarnRotaryEmbedding in MLA and the indexer


def _routing_kwargs(hf: dict) -> dict:
    experts, topk = hf["n_routed_experts"], hf["num_experts_per_tok"]
    groups, group_topk = get(hf, "n_group", 1), get(hf, "topk_group", 1)
    if not get(hf, "norm_topk_prob", True):
        _fail(hf, "norm_topk_prob=false is not supported (Megatron's sigmoid router renormalizes)")
    if topk < 2:
        _fail(hf, "num_experts_per_tok must be >= 2 (Megatron skips renormalizing a single expert)")
    if experts % groups or experts // groups < 2 or not 1 <= group_topk <= groups:
        _fail(hf, f"n_group ({groups}) / topk_group ({group_topk}) do not fit {experts} experts")
    if group_topk == groups:  # every group is kept: plain top-k
        return dict(moe_router_num_groups=None, moe_router_group_topk=None)
    if topk // group_topk != 2:
        _fail(hf, f"group-limited routing needs num_experts_per_tok // topk_group == 2 (HF scores "
                  f"a group by its top-2 experts), got {topk} // {group_topk}")
    return dict(moe_router_num_groups=groups, moe_router_group_topk=group_topk)


def transformer_config(hf: dict, options: ModelOptions) -> MLATransformerConfig:
    """Megatron ``MLATransformerConfig`` for a normalized GLM-5 config (validated)."""
    hf = normalize_hf_config(hf)
    kwargs = options.config_kwargs()
    tp, ep = kwargs["tensor_model_parallel_size"], kwargs["expert_model_parallel_size"]
    tp_flag = "--tensor-model-parallel-size"
    for field in ("num_attention_heads", "intermediate_size", "moe_intermediate_size",
                  "vocab_size", "q_lora_rank"):
        _check_divisible(hf[field], field, tp, tp_flag)
    _check_divisible(hf["kv_lora_rank"] + hf["qk_rope_head_dim"],
                     "kv_lora_rank + qk_rope_head_dim", tp, tp_flag)
    _check_divisible(hf["n_routed_experts"], "n_routed_experts", ep, "--expert-model-parallel-size")
    if tp > 1 and not kwargs["sequence_parallel"]:
        raise ValueError("GLM-5 (Megatron's absorbed MLA) needs --sequence-parallel when "
                         "--tensor-model-parallel-size > 1")
    if get(hf, "num_key_value_heads", hf["num_attention_heads"]) != hf["num_attention_heads"]:
        _fail(hf, "num_key_value_heads must equal num_attention_heads (MLA has one KV per head)")
    for flag in ("attention_bias", "mlp_bias"):
        if get(hf, flag, False):
            _fail(hf, f"{flag}=true is not supported for GLM-5")
    if get(hf, "hidden_act", "silu") != "silu":
        _fail(hf, f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
    if hf["index_head_dim"] < hf["qk_rope_head_dim"]:
        _fail(hf, "index_head_dim must be >= qk_rope_head_dim")
    topk_freq, skip_offset = _indexer_share_schedule(hf)
    shared = get(hf, "n_shared_experts", 1)
    return MLATransformerConfig(
        **kwargs,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"],
        layernorm_epsilon=get(hf, "rms_norm_eps", 1e-5),
        # MLA
        multi_latent_attention=True,
        q_lora_rank=hf["q_lora_rank"],
        kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        qk_layernorm=True,
        **_rope_kwargs(hf),
        # DSA
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=hf["index_n_heads"],
        dsa_indexer_head_dim=hf["index_head_dim"],
        dsa_indexer_topk=hf["index_topk"],
        dsa_indexer_topk_freq=topk_freq,
        dsa_indexer_skip_topk_offset=skip_offset,
        dsa_indexer_rope_interleaved=True,
        dsa_indexer_rotate_activation=False,
        dsa_indexer_scoring_relu=True,
        dsa_indexer_k_norm_epsilon=HF_INDEXER_NORM_EPS,
        # Megatron's own (unbound) DSA forward under CP all-gathers; LongStraw's capture/replay
        # shard the prompt state themselves (attention/cp_sparse_attention.py)
        cp_comm_type="allgather" if kwargs["context_parallel_size"] > 1 else None,
        # MoE
        num_moe_experts=hf["n_routed_experts"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_layer_freq=[int(t == "sparse") for t in hf["mlp_layer_types"]],
        moe_router_topk=hf["num_experts_per_tok"],
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=get(hf, "routed_scaling_factor", 1.0),
        moe_router_dtype="fp64" if kwargs["params_dtype"] == torch.float64 else "fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_shared_expert_intermediate_size=hf["moe_intermediate_size"] * shared if shared else None,
        moe_token_dispatcher_type="alltoall" if ep > 1 else "allgather",
        moe_grouped_gemm=False,
        **_routing_kwargs(hf),
    )


def gpt_model_kwargs(hf: dict) -> dict:
    """Vocabulary and tying for ``GPTModel`` (RoPE lives inside MLA, configured in the config)."""
    return dict(
        vocab_size=hf["vocab_size"],
        max_sequence_length=get(hf, "max_position_embeddings", 202_752),
        position_embedding_type="rope",  # GPTModel builds no rotary module for MLA
        share_embeddings_and_output_weights=get(hf, "tie_word_embeddings", False),
    )
