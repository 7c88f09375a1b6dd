"""Qwen3.5 / Qwen3.6 hybrid family (HF ``qwen3_5`` / ``qwen3_5_text``): the config, its checks
and Megatron's ``TransformerConfig`` and ``GPTModel`` settings for it.

Layers follow HF ``layer_types``: ``linear_attention`` layers are Megatron's ``GatedDeltaNet``
(fused in_proj ``[q, k, v, z, beta, alpha]``, causal conv over ``[q, k, v]``, gated RMSNorm,
L2-normed q/k), ``full_attention`` layers are Megatron's ``SelfAttention`` with the output gate,
per-head zero-centred q/k RMSNorm and partial RoPE (0.25), core attention from this project.
Every layer has a SwiGLU MLP; all RMSNorms are zero-centred ("1 + w") except Gated DeltaNet's
output norm, which is plain ``w`` in HF and stays plain here, so weights map one to one.
"""

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_longstraw.models.hf_config import get, require, rope_parameters
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.rope import check_rope_type

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
NAME = "Qwen3.5"

HYBRID_REQUIRED = (
    "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "linear_conv_kernel_dim",
    "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
    "linear_num_value_heads", "layer_types",
)
"""The fields of the hybrid stack every Qwen3.5 config has (the MLP's come on top)."""
_REQUIRED = HYBRID_REQUIRED + ("intermediate_size",)
_LAYER_TYPES = ("linear_attention", "full_attention")


def flatten_hf_config(hf: dict, wrapper: str, text: str) -> dict:
    """A multimodal ``wrapper`` config flattened to its ``text_config`` (``model_type`` ``text``);
    any other config copied."""
    if hf.get("model_type") == wrapper:
        if "text_config" not in hf:
            raise ValueError(f"{hf.get('_source', 'config')}: missing field 'text_config'")
        flat = dict(hf["text_config"])
        flat.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
        flat["model_type"] = text
        flat["_source"] = hf.get("_source", "config")
        return flat
    return dict(hf)


def check_hybrid_layers(hf: dict, required: tuple[str, ...], family: str) -> dict:
    """Fill ``layer_types`` as HF does (``full_attention_interval``) and validate the fields."""
    if hf.get("layer_types") is None and hf.get("num_hidden_layers"):
        interval = get(hf, "full_attention_interval", 4)
        hf["layer_types"] = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(hf["num_hidden_layers"])
        ]
    require(hf, required, family)
    bad = [t for t in hf["layer_types"] if t not in _LAYER_TYPES]
    if bad or len(hf["layer_types"]) != hf["num_hidden_layers"]:
        raise ValueError(
            f"{hf.get('_source', 'config')}: layer_types must list {hf['num_hidden_layers']} "
            f"entries from {_LAYER_TYPES}, got {len(hf['layer_types'])} (bad: {bad[:3]})"
        )
    return hf


def normalize_hf_config(hf: dict) -> dict:
    """Flatten a ``qwen3_5`` (multimodal) config to its ``text_config`` and validate it."""
    return check_hybrid_layers(flatten_hf_config(hf, "qwen3_5", "qwen3_5_text"), _REQUIRED, NAME)


def _check_divisible(value: int, what: str, tp: int) -> None:
    if value % tp:
        raise ValueError(f"{what} ({value}) is not divisible by --tensor-model-parallel-size {tp}")


def hybrid_config_kwargs(hf: dict, options: ModelOptions, tp_fields: tuple[str, ...] = ()) -> dict:
    """``TransformerConfig`` keywords of the hybrid stack (Gated DeltaNet and gated attention per
    ``layer_types``, zero-centred norms) for a normalized config; ``tp_fields`` are more fields
    TP must divide."""
    kwargs = options.config_kwargs()
    tp = kwargs["tensor_model_parallel_size"]
    for field in ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads",
                  "linear_num_value_heads", "vocab_size") + tp_fields:
        _check_divisible(hf[field], field, tp)
    if hf["linear_num_value_heads"] % hf["linear_num_key_heads"]:
        raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    linear_pattern = [int(t == "linear_attention") for t in hf["layer_types"]]
    return dict(
        **kwargs,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf["num_key_value_heads"],
        kv_channels=hf["head_dim"],
        layernorm_epsilon=get(hf, "rms_norm_eps", 1e-6),
        layernorm_zero_centered_gamma=True,
        qk_layernorm=True,
        attention_output_gate=True,
        add_qkv_bias=get(hf, "attention_bias", False),
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=linear_pattern,
        linear_conv_kernel_dim=hf["linear_conv_kernel_dim"],
        linear_key_head_dim=hf["linear_key_head_dim"],
        linear_value_head_dim=hf["linear_value_head_dim"],
        linear_num_key_heads=hf["linear_num_key_heads"],
        linear_num_value_heads=hf["linear_num_value_heads"],
    )


def transformer_config(hf: dict, options: ModelOptions) -> TransformerConfig:
    """Megatron ``TransformerConfig`` for a normalized Qwen3.5 config: the hybrid stack, a SwiGLU
    MLP in every layer."""
    return TransformerConfig(**hybrid_config_kwargs(hf, options, ("intermediate_size",)),
                             ffn_hidden_size=hf["intermediate_size"])


def gpt_model_kwargs(hf: dict) -> dict:
    """Vocabulary, RoPE (``default`` or ``yarn``) and tying settings for ``GPTModel``."""
    rope = rope_parameters(hf)
    check_rope_type(hf, "Qwen3.5")  # YaRN: its frequencies and factor go in after the build (models/rope.py)
    return dict(
        vocab_size=hf["vocab_size"],
        max_sequence_length=get(hf, "max_position_embeddings", 262_144),
        position_embedding_type="rope",
        rotary_percent=get(rope, "partial_rotary_factor", 0.25),
        rotary_base=get(rope, "rope_theta", 10_000_000),
        share_embeddings_and_output_weights=get(hf, "tie_word_embeddings", False),
    )
