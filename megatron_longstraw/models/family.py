"""What a model family gives the rest of the package: one typed ``ModelFamily`` (after
torchtitan's ``ModelSpec``), assembled in the family's package (``models/<family>/``) and
registered there by the exact HF ``model_type`` strings it serves (``models/registry.py``)."""

from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Mapping, Optional

from megatron_longstraw.models.weight_map import WeightMap

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_longstraw.config.parallel import ParallelSizes
    from megatron_longstraw.models.options import ModelOptions
    from megatron_longstraw.models.profile import ModelProfile


def no_layout_limits(hf: dict, parallel: "ParallelSizes", rollout_source: str) -> None:
    """A family that serves every parallel layout its ``transformer_config`` accepts."""


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """One model family: its configs, its Megatron modules, its weights, its cost."""

    name: str
    """For messages: ``"Qwen3.5"``."""
    model_types: tuple[str, ...]
    """The exact HF ``model_type`` strings it serves."""
    normalize_hf_config: Callable[[dict], dict]
    """HF config dict -> flat text-model config dict, validated (``ValueError`` naming the file
    and field)."""
    transformer_config: Callable[[dict, "ModelOptions"], "TransformerConfig"]
    """``(normalized hf, ModelOptions) -> TransformerConfig``."""
    block_spec: Callable
    """``(TransformerConfig, backend, vp_stage=None, pp_rank=None) -> TransformerBlockSubmodules``
    of this pipeline stage's layers."""
    gpt_model_kwargs: Callable[[dict], dict]
    """``hf -> GPTModel`` keywords (vocabulary, RoPE, tying)."""
    weights: WeightMap
    """The HF <-> Megatron weight table (``models/weight_map.py``)."""
    tp_sections: Callable[[str, "TransformerConfig"], Optional[list[int]]]
    """``(Megatron weight name, config) ->`` full-size sections of a fused tensor that TP splits
    section by section, or ``None``."""
    hf_output_config: Callable[[dict], dict]
    """``hf -> config.json`` written next to converted HF weights."""
    hf_reference: Callable[[str], Optional[tuple[str, str, str, str]]]
    """``model_type -> (modeling module, model class, configuration module, config class)`` of
    the transformers reference model, or ``None``."""
    prompt_flops: Callable[[dict, object, int], Optional[float]]
    """``(normalized hf, model, prompt length) ->`` capture forward FLOPs, or ``None``."""
    response_forward_flops: Callable[[dict, object, int, int], Optional[float]]
    """``(normalized hf, model, prompt length, response tokens) ->`` forward FLOPs, or ``None``."""
    presets: Mapping[str, dict] = field(default_factory=dict)
    """Named configs (``--model NAME``), a tiny ``*-debug`` one among them."""
    check_layout: Callable[[dict, "ParallelSizes", str], None] = no_layout_limits
    """``(hf, ParallelSizes, rollout source) -> None``: ``ValueError`` naming the flag of a layout
    the family refuses."""
    plan_profile: Optional[Callable[[dict], "ModelProfile"]] = None
    """``hf -> ModelProfile`` (the budget planner's view, ``models/profile.py``); a family
    without it is not planned (``tools/plan_budget.py`` refuses, the trainer skips its check)."""

    @classmethod
    def of_package(cls, *, config: ModuleType, spec: ModuleType, convert: ModuleType, profile: ModuleType,
                   presets: ModuleType, **fields) -> "ModelFamily":
        """The family of a package laid out as the built-in ones are (``models/qwen3_5/``):
        ``config`` (``NAME``, ``MODEL_TYPES``, ``normalize_hf_config``, ``transformer_config``,
        ``gpt_model_kwargs``), ``spec`` (``block_spec``), ``convert`` (``WEIGHTS``,
        ``tp_sections``, ``hf_output_config``, ``hf_reference``), ``profile`` (``prompt_flops``,
        ``response_forward_flops``, ``plan_profile``), ``presets`` (``PRESETS``); ``fields``
        give the rest (``check_layout``) or replace any."""
        return cls(**{**dict(
            name=config.NAME, model_types=config.MODEL_TYPES, normalize_hf_config=config.normalize_hf_config,
            transformer_config=config.transformer_config, gpt_model_kwargs=config.gpt_model_kwargs,
            block_spec=spec.block_spec, weights=convert.WEIGHTS, tp_sections=convert.tp_sections,
            hf_output_config=convert.hf_output_config, hf_reference=convert.hf_reference,
            prompt_flops=profile.prompt_flops, response_forward_flops=profile.response_forward_flops,
            plan_profile=profile.plan_profile, presets=presets.PRESETS), **fields})

    def __post_init__(self):
        types = self.model_types
        if isinstance(types, str) or not types or not all(isinstance(t, str) for t in types):
            raise ValueError(f"model family {self.name}: model_types must be a non-empty tuple of HF model_type "
                             "strings")
