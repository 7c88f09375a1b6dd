"""Qwen3.5's HF side: the weight table (``models/weight_map.py``), TP's fused sections, the
config written beside converted weights and the transformers reference model.

Weight layout differences the table handles:
- attention ``q_proj`` rows are per head ``[q_h, gate_h]``; Megatron's ``linear_qkv`` rows are per
  KV group ``[q heads of g, gate heads of g, k_g, v_g]``;
- GDN ``in_proj_qkv|z|b|a`` concatenate into ``in_proj`` (TP splits each section, ``tp_sections``);
- MLP ``gate_proj``/``up_proj`` concatenate into ``linear_fc1``.

A multimodal checkpoint (``model.language_model.*``) is read as the text model; its vision tower
(``model.visual.*``) is dropped. The multi-token-prediction layers (``mtp.*``, which transformers
ignores too) are kept: a converted checkpoint holds them unchanged and its export writes them back
(``checkpointing/hf_assets.py``), ``mtp_num_hidden_layers`` of them.
"""

import re

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_longstraw.models.qwen3_5.config import normalize_hf_config
from megatron_longstraw.models.weight_map import MODEL_RULES, WeightMap, WeightRule, gate_up_rule, layer_rules, rows_of

_HF_TEXT_MODEL = ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5ForCausalLM",
                  "transformers.models.qwen3_5.configuration_qwen3_5", "Qwen3_5TextConfig")


def hf_reference(model_type: str) -> tuple[str, str, str, str] | None:
    """``(modeling module, model class, configuration module, config class)`` of the transformers
    text model, the reference of the parity tests; ``None`` for the multimodal ``qwen3_5``
    wrapper (its normalized config, ``qwen3_5_text``, has the reference)."""
    return None if model_type == "qwen3_5" else _HF_TEXT_MODEL


def text_output_config(hf: dict, wrapper: str, normalize, architecture: str) -> dict:
    """The ``config.json`` written next to converted weights: the text model's config
    (``architecture``) for a multimodal ``wrapper`` config, whose vision tower is not in the
    Megatron checkpoint; any other config as given."""
    if hf.get("model_type") == wrapper:
        config = {k: v for k, v in normalize(hf).items() if not k.startswith("_")}
        config["architectures"] = [architecture]
        return config
    return {k: v for k, v in hf.items() if not k.startswith("_")}


def hf_output_config(hf: dict) -> dict:
    """``text_output_config`` of Qwen3.5 (``Qwen3_5ForCausalLM``)."""
    return text_output_config(hf, "qwen3_5", normalize_hf_config, _HF_TEXT_MODEL[1])


# ---- weight table

def _qkv_to_mcore(tensors: list[torch.Tensor], hf: dict) -> torch.Tensor:
    """HF ``q_proj`` (per head ``[q_h, gate_h]``), ``k_proj``, ``v_proj`` -> ``linear_qkv``."""
    q_gate, k, v = tensors
    heads, groups, dim = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    per_group = heads // groups
    q_gate = q_gate.reshape(groups, per_group, 2, dim, -1)
    q, gate = q_gate[:, :, 0], q_gate[:, :, 1]
    k, v = k.reshape(groups, 1, dim, -1), v.reshape(groups, 1, dim, -1)
    fused = torch.cat([q.reshape(groups, per_group * dim, -1), gate.reshape(groups, per_group * dim, -1),
                       k.reshape(groups, dim, -1), v.reshape(groups, dim, -1)], dim=1)
    return fused.reshape(-1, fused.shape[-1])


def _qkv_to_hf(fused: torch.Tensor, hf: dict) -> list[torch.Tensor]:
    """``linear_qkv`` -> HF ``q_proj``, ``k_proj``, ``v_proj`` (inverse of ``_qkv_to_mcore``)."""
    heads, groups, dim = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    per_group = heads // groups
    fused = fused.reshape(groups, (2 * per_group + 2) * dim, -1)
    q, gate, k, v = torch.split(fused, [per_group * dim, per_group * dim, dim, dim], dim=1)
    q_gate = torch.stack([q.reshape(groups, per_group, dim, -1), gate.reshape(groups, per_group, dim, -1)], dim=2)
    return [q_gate.reshape(heads * 2 * dim, -1), k.reshape(groups * dim, -1), v.reshape(groups * dim, -1)]


def _in_proj_rows(hf: dict) -> list[int]:
    """Rows of Gated DeltaNet's HF ``in_proj_qkv``, ``_z``, ``_b``, ``_a``."""
    qk = hf["linear_num_key_heads"] * hf["linear_key_head_dim"]
    v = hf["linear_num_value_heads"] * hf["linear_value_head_dim"]
    return [2 * qk + v, v, hf["linear_num_value_heads"], hf["linear_num_value_heads"]]


def _layer_type(kind: str):
    return lambda hf, fields: hf["layer_types"][fields["layer"]] == kind


def _mtp_layer(name: str) -> int | None:
    """The multi-token-prediction layer of an ``mtp.layers.{i}.*`` tensor."""
    match = re.match(r"(?:model\.)?mtp\.layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None


_HF_LAYER, _LAYER = "model.layers.{layer}.", "decoder.layers.{layer}."

HYBRID_RULES = layer_rules((
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
    ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
    ("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
    ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight"),
    ("linear_attn.conv1d.weight", "self_attention.conv1d.weight"),
    ("linear_attn.dt_bias", "self_attention.dt_bias"),
    ("linear_attn.A_log", "self_attention.A_log"),
    ("linear_attn.norm.weight", "self_attention.out_norm.weight"),
    ("linear_attn.out_proj.weight", "self_attention.out_proj.weight"),
)) + (
    WeightRule(_LAYER + "self_attention.linear_qkv.weight",
               tuple(_HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"),
               join=_qkv_to_mcore, split=_qkv_to_hf, applies=_layer_type("full_attention")),
    WeightRule(_LAYER + "self_attention.in_proj.weight",
               tuple(_HF_LAYER + f"linear_attn.{p}.weight" for p in ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                      "in_proj_a")),
               split=rows_of(_in_proj_rows), applies=_layer_type("linear_attention")),
)
"""Every layer's norms and mixer (Gated DeltaNet or gated attention): the layer weights the
Qwen3.5 families share."""


def hybrid_weight_map(mlp_rules: tuple[WeightRule, ...], normalize, **fields) -> WeightMap:
    """The weight table of a Qwen3.5 family whose MLP weights are ``mlp_rules``: HF names under
    ``model.`` or ``model.language_model.``, the vision tower dropped, ``mtp.*`` kept; ``fields``:
    more ``WeightMap`` settings."""
    return WeightMap(
        rules=MODEL_RULES + HYBRID_RULES + mlp_rules,
        hf_prefixes=(("model.language_model.", "model."),),
        dropped=lambda name, hf: name.startswith("model.visual."),
        kept=lambda name, hf: name.startswith(("mtp.", "model.mtp.")),
        kept_layer=lambda name, hf: _mtp_layer(name),
        kept_layers_field="mtp_num_hidden_layers",
        normalize=normalize,
        **fields,
    )


WEIGHTS = hybrid_weight_map((
    gate_up_rule(_HF_LAYER + "mlp.", _LAYER + "mlp.linear_fc1.weight"),
    WeightRule(_LAYER + "mlp.linear_fc2.weight", (_HF_LAYER + "mlp.down_proj.weight",)),
), normalize_hf_config)
"""Qwen3.5's weight table; HF names under ``model.`` (or ``model.language_model.``)."""


def tp_sections(name: str, config: TransformerConfig) -> list[int] | None:
    """Full-size sections of fused tensors that TP splits section by section (the mixers' and a
    dense MLP's; ``qwen3_5_moe``'s add the experts')."""
    qk = config.linear_num_key_heads * config.linear_key_head_dim
    v = config.linear_num_value_heads * config.linear_value_head_dim
    if name.endswith("self_attention.in_proj.weight"):
        return [qk, qk, v, v, config.linear_num_value_heads, config.linear_num_value_heads]
    if name.endswith("self_attention.conv1d.weight"):
        return [qk, qk, v]
    if name.endswith("mlp.linear_fc1.weight"):
        return [config.ffn_hidden_size, config.ffn_hidden_size]
    return None
