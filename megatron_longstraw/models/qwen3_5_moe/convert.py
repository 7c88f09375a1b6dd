"""Qwen3.5-MoE's HF side: the weight table (``models/weight_map.py``), TP's fused sections, the
config written beside converted weights and the transformers reference model.

The layers' norms and mixers map as Qwen3.5's (``models/qwen3_5/convert.py``). The MoE block:
``mlp.gate`` is the router, ``mlp.shared_expert.*`` the shared expert (``gate_proj`` and
``up_proj`` fused into ``linear_fc1``), ``mlp.shared_expert_gate`` its ``gate_weight``. Routed
experts are stacked (``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` / ``down_proj`` ``[E, H, I]``:
the official checkpoints' and transformers' layout, which an export writes; it converts a layer's
experts together, ``WeightMap.export_groups``) or, read only, one tensor per expert
(``mlp.experts.{e}.gate_proj.weight``, the layout of some quantized exports). The Megatron
weights name every expert by its global number (``local_experts.{e}``).
"""

import re

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_longstraw.models.qwen3_5 import convert as hybrid
from megatron_longstraw.models.qwen3_5_moe.config import normalize_hf_config
from megatron_longstraw.models.weight_map import WeightRule, gate_up_rule, layer_rules

_HF_TEXT_MODEL = ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeForCausalLM",
                  "transformers.models.qwen3_5_moe.configuration_qwen3_5_moe", "Qwen3_5MoeTextConfig")


def hf_reference(model_type: str) -> tuple[str, str, str, str] | None:
    """The transformers text model (``Qwen3_5MoeForCausalLM``), the reference of the parity
    tests; ``None`` for the multimodal ``qwen3_5_moe`` wrapper (its normalized config has it)."""
    return None if model_type == "qwen3_5_moe" else _HF_TEXT_MODEL


def hf_output_config(hf: dict) -> dict:
    """The ``config.json`` written next to converted weights (``qwen3_5``'s ``text_output_config``)."""
    return hybrid.text_output_config(hf, "qwen3_5_moe", normalize_hf_config, _HF_TEXT_MODEL[1])


_HF_LAYER, _LAYER = "model.layers.{layer}.", "decoder.layers.{layer}."
_EXPERTS_HF, _EXPERTS = _HF_LAYER + "mlp.experts.", _LAYER + "mlp.experts.local_experts.{expert}."


WEIGHTS = hybrid.hybrid_weight_map(layer_rules((
    ("mlp.gate.weight", "mlp.router.weight"),
    ("mlp.shared_expert.down_proj.weight", "mlp.shared_experts.linear_fc2.weight"),
    ("mlp.shared_expert_gate.weight", "mlp.shared_experts.gate_weight"),
)) + (
    gate_up_rule(_HF_LAYER + "mlp.shared_expert.", _LAYER + "mlp.shared_experts.linear_fc1.weight"),
    # routed experts: stacked (the official checkpoints and transformers' modules; what an export
    # writes) or one tensor per expert (some quantized exports; read only)
    WeightRule(_EXPERTS + "linear_fc1.weight", (_EXPERTS_HF + "gate_up_proj",), hf_stacked=True),
    WeightRule(_EXPERTS + "linear_fc2.weight", (_EXPERTS_HF + "down_proj",), hf_stacked=True),
    gate_up_rule(_EXPERTS_HF + "{expert}.", _EXPERTS + "linear_fc1.weight", layout="read"),
    WeightRule(_EXPERTS + "linear_fc2.weight", (_EXPERTS_HF + "{expert}.down_proj.weight",), layout="read"),
), normalize_hf_config, num_experts_field="num_experts")
"""Qwen3.5-MoE's weight table; HF names under ``model.`` (or ``model.language_model.``)."""


def tp_sections(name: str, config: TransformerConfig) -> list[int] | None:
    """Full-size sections of fused tensors that TP splits section by section: the mixers' and
    the experts' ``[gate; up]``."""
    if name.endswith("shared_experts.linear_fc1.weight"):
        return [config.moe_shared_expert_intermediate_size] * 2
    if re.search(r"experts\.local_experts\.\d+\.linear_fc1\.weight$", name):
        return [config.moe_ffn_hidden_size] * 2
    return hybrid.tp_sections(name, config)
