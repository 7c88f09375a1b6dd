"""Build a family's Megatron ``GPTModel`` and move full (unsharded) weights in and out of it."""

import re
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from megatron_longstraw.attention.fp8_capture_attention import enable_fp8_capture_attention
from megatron_longstraw.attention.kernel_options import set_kernel_options
from megatron_longstraw.models.options import ModelOptions, backend_provider
from megatron_longstraw.models.pipeline_stage import StageChunks, chunk_layer_ids
from megatron_longstraw.models.registry import family_for
from megatron_longstraw.models.rope import scale_rope


def build_model(hf: dict, options: ModelOptions = ModelOptions(), *,
                parallel_output: bool = True, pre_process: Optional[bool] = None,
                post_process: Optional[bool] = None, vp_stage: Optional[int] = None,
                to_device: bool = True) -> GPTModel:
    """Build the Megatron model for an HF-style config dict on this rank's pipeline stage.

    ``to_device=False`` leaves the parameters where they were created (e.g. the meta device).
    The attention modules take ``options.kernel_options``.
    """
    family = family_for(hf.get("model_type"))
    hf = family.normalize_hf_config(hf)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if hf["num_hidden_layers"] % pp:
        raise ValueError(f"--pipeline-model-parallel-size {pp} does not divide the model's "
                         f"{hf['num_hidden_layers']} layers")
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    if hf["num_hidden_layers"] % (pp * vpp):
        raise ValueError(f"--pipeline-model-parallel-size {pp} x --num-virtual-stages-per-pipeline-rank {vpp} "
                         f"does not divide the model's {hf['num_hidden_layers']} layers")
    backend = backend_provider(options)
    config = family.transformer_config(hf, options)
    if options.fp8_format is not None and torch.cuda.is_available():
        from megatron_longstraw.models.fp8 import probe_fp8_recipe

        probe_fp8_recipe(config)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=family.block_spec(config, backend, vp_stage=vp_stage),
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        vp_stage=vp_stage,
        **family.gpt_model_kwargs(hf),
    )
    model.hf_config = hf
    scale_rope(model, hf)  # YaRN's frequencies and cos/sin factor
    set_kernel_options(model, options.kernel_options)
    if options.fp8_attention == "capture":
        enable_fp8_capture_attention(model)
    if to_device and torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def build_stage_model(hf: dict, options: ModelOptions = ModelOptions(), **kwargs):
    """This rank's model: ``build_model``, or under virtual pipeline stages a ``StageChunks`` of
    one ``build_model`` per virtual stage (``vp_stage`` 0, 1, ...)."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    if vpp == 1:
        return build_model(hf, options, **kwargs)
    return StageChunks([build_model(hf, options, vp_stage=v, **kwargs) for v in range(vpp)])


_TE_FUSED_NORMS = (
    # local-spec name suffix -> Transformer Engine fused-norm names to try, in order
    (".input_layernorm.weight", (".self_attention.linear_qkv.layer_norm_weight",
                                 ".self_attention.in_proj.layer_norm_weight")),
    (".pre_mlp_layernorm.weight", (".mlp.linear_fc1.layer_norm_weight",)),
)


def spec_param_name(name: str, params: dict) -> str:
    """Map a local-spec parameter name onto the name it has among ``params`` (a model's
    ``named_parameters()``; with the Transformer Engine spec the norms are fused into the
    following linear layer)."""
    if name in params:
        return name
    for suffix, fused in _TE_FUSED_NORMS:
        if name.endswith(suffix):
            for alt in fused:
                candidate = name[: -len(suffix)] + alt
                if candidate in params:
                    return candidate
    return name


def shard_for_rank(full: torch.Tensor, dim: int, rank: int, size: int,
                   sections: Optional[list[int]] = None) -> torch.Tensor:
    """This TP rank's slice of ``full`` along ``dim``; fused ``sections`` split separately."""
    if size == 1:
        return full
    parts = torch.split(full, sections, dim=dim) if sections else (full,)
    shards = []
    for part in parts:
        if part.shape[dim] % size:
            raise ValueError(f"dimension {part.shape[dim]} is not divisible by TP size {size}")
        shards.append(torch.chunk(part, size, dim=dim)[rank])
    return torch.cat(shards, dim=dim)


_EXPERT_NAME = re.compile(r"(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)")


def _expert_local_name(name: str, config) -> Optional[str]:
    """``...local_experts.{global}...`` -> this EP rank's local name, or None if not local."""
    match = _EXPERT_NAME.fullmatch(name)
    if match is None:
        return name
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    per_rank = config.num_moe_experts // ep_size
    owner, local = divmod(int(match.group(2)), per_rank)
    if owner != parallel_state.get_expert_model_parallel_rank():
        return None
    return f"{match.group(1)}{local}{match.group(3)}"


def expert_global_name(name: str, first_expert: int) -> str:
    """``...local_experts.{local}...`` on an EP rank whose first expert is ``first_expert`` -> the
    whole model's name (``local_experts.{global}``); other names are returned unchanged."""
    match = _EXPERT_NAME.fullmatch(name)
    return name if match is None else f"{match.group(1)}{first_expert + int(match.group(2))}{match.group(3)}"


def _stage_name(name: str, model: GPTModel, local_ids: dict[int, int]) -> Optional[str]:
    """A full-model weight name on this pipeline stage (``decoder.layers.{global}`` renumbered to
    the stage's local index), or None when the weight lives on another stage. A stage that has
    the output layer but not the embedding takes a tied embedding as its output weight."""
    if name.startswith("decoder.layers."):
        parts = name.split(".")
        local = local_ids.get(int(parts[2]))
        return None if local is None else ".".join([*parts[:2], str(local), *parts[3:]])
    if name.startswith("embedding."):
        if model.pre_process:
            return name
        tied = name == "embedding.word_embeddings.weight" and model.share_embeddings_and_output_weights
        return "output_layer.weight" if tied and model.post_process else None
    if name.startswith(("output_layer.", "decoder.final_layernorm.")):
        return name if model.post_process else None
    return name


@torch.no_grad()
def load_full_state_dict(model: GPTModel | StageChunks, full: dict[str, torch.Tensor]) -> None:
    """Copy full (TP-unsharded, local-spec-named) weights into this rank's model.

    Every model parameter must be provided and every provided tensor must be used, except the
    weights of other pipeline stages (``_stage_name``: layers are renumbered). MoE experts are
    named by their global number (``local_experts.{e}``); only this EP rank's experts are
    loaded, renumbered locally, and they are TP-split over the expert-tensor-parallel group.
    Buffers (e.g. the router's ``expert_bias``) are loaded when given. Under virtual pipeline
    stages (a ``StageChunks``) each chunk takes its own layers.
    """
    if isinstance(model, StageChunks):
        for chunk in model:
            load_full_state_dict(chunk, full)
        return
    family = family_for(model.hf_config["model_type"])
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    used = set()
    local_ids = {g: i for i, g in enumerate(chunk_layer_ids(model))}
    for name, tensor in full.items():
        name = _stage_name(name, model, local_ids)
        if name is None:
            continue  # a weight of another pipeline stage
        local = _expert_local_name(name, model.config)
        if local is None:
            continue  # an expert of another EP rank
        target = spec_param_name(local, params)
        if target not in params and target not in buffers:
            raise ValueError(f"weight {name!r} has no parameter in the model")
        param = params[target] if target in params else buffers[target]
        if getattr(param, "tensor_model_parallel", False):
            if getattr(param, "allreduce", True):  # dense parameter
                tp_rank = parallel_state.get_tensor_model_parallel_rank()
                tp_size = parallel_state.get_tensor_model_parallel_world_size()
            else:  # expert parameter
                tp_rank = parallel_state.get_expert_tensor_parallel_rank()
                tp_size = parallel_state.get_expert_tensor_parallel_world_size()
            tensor = shard_for_rank(tensor, param.partition_dim, tp_rank, tp_size,
                                    family.tp_sections(name, model.config))
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"weight {name!r}: shape {tuple(tensor.shape)} does not match {tuple(param.shape)}"
            )
        param.copy_(tensor.to(param.dtype))
        used.add(target)
    missing = sorted(set(params) - used)
    if missing:
        raise ValueError(f"no weights given for {len(missing)} parameters, e.g. {missing[:3]}")
