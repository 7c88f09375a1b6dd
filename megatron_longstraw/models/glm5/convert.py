"""GLM-5's HF side: the weight table (``models/weight_map.py``), TP's fused sections, the config
written beside converted weights and the transformers reference model.

Routed experts come stacked (``mlp.experts.gate_up_proj`` / ``down_proj``, transformers' module
layout) or one tensor per expert (``mlp.experts.{e}.gate_proj.weight``, the layout of HF
checkpoint files); the Megatron weights name every expert by its global number
(``local_experts.{e}``, ``models/builder.py``'s ``load_full_state_dict`` keeps an EP rank's own).
The multi-token-prediction layer (``model.layers.{num_hidden_layers}.*``), which HF's model
ignores too, is kept: a converted checkpoint holds it unchanged and its export writes it back
(``checkpointing/hf_assets.py``), ``num_nextn_predict_layers`` of them.
"""

import re

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_longstraw.models.glm5.config import normalize_hf_config
from megatron_longstraw.models.weight_map import MODEL_RULES, WeightMap, WeightRule, gate_up_rule, layer_rules


def hf_reference(model_type: str) -> tuple[str, str, str, str]:
    """``(modeling module, model class, configuration module, config class)`` of the transformers
    model, the reference of the parity tests."""
    return ("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", "GlmMoeDsaForCausalLM",
            "transformers.models.glm_moe_dsa.configuration_glm_moe_dsa", "GlmMoeDsaConfig")


def hf_output_config(hf: dict) -> dict:
    """The ``config.json`` written next to converted weights: the config as given."""
    return {k: v for k, v in hf.items() if not k.startswith("_")}


# ---- weight table

def _sparse(hf: dict, fields: dict) -> bool:
    return hf["mlp_layer_types"][fields["layer"]] == "sparse"


def _mtp_layer(name: str, hf: dict) -> int | None:
    """The multi-token-prediction layer of a tensor of a layer from ``num_hidden_layers`` on."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return int(match.group(1)) if match is not None and int(match.group(1)) >= hf["num_hidden_layers"] else None


_HF_LAYER, _LAYER = "model.layers.{layer}.", "decoder.layers.{layer}."
_ATTN = "self_attention."
_INDEXER = _ATTN + "core_attention.indexer."
_EXPERTS_HF, _EXPERTS = _HF_LAYER + "mlp.experts.", _LAYER + "mlp.experts.local_experts.{expert}."


WEIGHTS = WeightMap(
    rules=MODEL_RULES + layer_rules((
        ("input_layernorm.weight", "input_layernorm.weight"),
        ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
        ("self_attn.q_a_proj.weight", _ATTN + "linear_q_down_proj.weight"),
        ("self_attn.q_a_layernorm.weight", _ATTN + "q_layernorm.weight"),
        ("self_attn.q_b_proj.weight", _ATTN + "linear_q_up_proj.weight"),
        ("self_attn.kv_a_proj_with_mqa.weight", _ATTN + "linear_kv_down_proj.weight"),
        ("self_attn.kv_a_layernorm.weight", _ATTN + "kv_layernorm.weight"),
        ("self_attn.kv_b_proj.weight", _ATTN + "linear_kv_up_proj.weight"),
        ("self_attn.o_proj.weight", _ATTN + "linear_proj.weight"),
        ("self_attn.indexer.wq_b.weight", _INDEXER + "linear_wq_b.weight"),
        ("self_attn.indexer.wk.weight", _INDEXER + "linear_wk.weight"),
        ("self_attn.indexer.k_norm.weight", _INDEXER + "k_norm.weight"),
        ("self_attn.indexer.k_norm.bias", _INDEXER + "k_norm.bias"),
        ("self_attn.indexer.weights_proj.weight", _INDEXER + "linear_weights_proj.weight"),
        ("mlp.down_proj.weight", "mlp.linear_fc2.weight"),
        ("mlp.gate.weight", "mlp.router.weight"),
        ("mlp.shared_experts.down_proj.weight", "mlp.shared_experts.linear_fc2.weight"),
    )) + (
        WeightRule(_LAYER + "mlp.router.expert_bias", (_HF_LAYER + "mlp.gate.e_score_correction_bias",),
                   applies=_sparse, required=True),
        gate_up_rule(_HF_LAYER + "mlp.", _LAYER + "mlp.linear_fc1.weight"),
        gate_up_rule(_HF_LAYER + "mlp.shared_experts.", _LAYER + "mlp.shared_experts.linear_fc1.weight"),
        # routed experts: one tensor per expert (checkpoint files) or stacked (transformers' modules)
        gate_up_rule(_EXPERTS_HF + "{expert}.", _EXPERTS + "linear_fc1.weight", layout="checkpoint"),
        WeightRule(_EXPERTS + "linear_fc2.weight", (_EXPERTS_HF + "{expert}.down_proj.weight",), layout="checkpoint"),
        WeightRule(_EXPERTS + "linear_fc1.weight", (_EXPERTS_HF + "gate_up_proj",), layout="module", hf_stacked=True),
        WeightRule(_EXPERTS + "linear_fc2.weight", (_EXPERTS_HF + "down_proj",), layout="module", hf_stacked=True),
    ),
    kept=lambda name, hf: _mtp_layer(name, hf) is not None,
    kept_layer=_mtp_layer,
    kept_layers_field="num_nextn_predict_layers",
    drop_warning="GLM-5: leaving out {count} MTP weights (model.layers.{num_hidden_layers}.*); multi-token "
                 "prediction is not part of the Megatron model (tools/convert_checkpoint.py keeps them for "
                 "the export)",
    normalize=normalize_hf_config,
)
"""GLM-5's weight table."""


def tp_sections(name: str, config: TransformerConfig) -> list[int] | None:
    """Full-size sections of fused tensors that TP splits section by section."""
    if name.endswith("shared_experts.linear_fc1.weight"):
        return [config.moe_shared_expert_intermediate_size] * 2
    if re.search(r"experts\.local_experts\.\d+\.linear_fc1\.weight$", name):
        return [config.moe_ffn_hidden_size] * 2
    if name.endswith("mlp.linear_fc1.weight"):
        return [config.ffn_hidden_size] * 2
    return None
