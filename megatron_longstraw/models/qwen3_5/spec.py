"""Qwen3.5's Megatron layer specs: Gated DeltaNet or gated full attention per ``layer_types``,
every layer with a SwiGLU MLP, or Megatron's ``MoELayer`` when the config has experts (the
Qwen3.5-MoE family), for the local or the Transformer Engine backend."""

from functools import partial

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_longstraw.attention.sdpa_core import SDPACoreAttention
from megatron_longstraw.models.gated_delta_net import LongStrawGatedDeltaNet
from megatron_longstraw.models.norms import PlainTENorm, RMSNorm
from megatron_longstraw.models.pipeline_stage import local_layer_ids


def _norm(backend, plain: bool = False):
    if backend.fuse_layernorm_and_linear():  # Transformer Engine
        return PlainTENorm if plain else backend.layer_norm(rms_norm=True)
    return ModuleSpec(module=RMSNorm, params={"zero_centered_gamma": False}) if plain else RMSNorm


def _attention_spec(backend) -> tuple[ModuleSpec, bool]:
    fused = backend.fuse_layernorm_and_linear()
    qkv = backend.column_parallel_layer_norm_linear() if fused else backend.column_parallel_linear()
    spec = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=qkv,
            core_attention=SDPACoreAttention,
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=_norm(backend),
            k_layernorm=_norm(backend),
        ),
    )
    return spec, fused


def _gated_delta_net_spec(backend) -> tuple[ModuleSpec, bool]:
    fused = backend.fuse_layernorm_and_linear()
    in_proj = backend.column_parallel_layer_norm_linear() if fused else backend.column_parallel_linear()
    spec = ModuleSpec(
        module=LongStrawGatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=in_proj, out_norm=_norm(backend, plain=True), out_proj=backend.row_parallel_linear()
        ),
    )
    return spec, fused


def _mlp_spec(config: TransformerConfig, backend) -> tuple[ModuleSpec, bool]:
    """The MLP and whether it takes the pre-MLP norm fused into its first linear (TE, dense)."""
    if config.num_moe_experts:  # the router reads the normed tokens: the norm stays its own module
        return get_moe_module_spec_for_backend(backend, num_experts=config.num_moe_experts,
                                               moe_grouped_gemm=False), False
    fused = backend.fuse_layernorm_and_linear()
    return partial(
        MLP.as_mlp_submodule,
        submodules=MLPSubmodules(
            linear_fc1=backend.column_parallel_layer_norm_linear() if fused else backend.column_parallel_linear(),
            linear_fc2=backend.row_parallel_linear(),
        ),
    ), fused


def block_spec(config: TransformerConfig, backend, vp_stage=None, pp_rank=None) -> TransformerBlockSubmodules:
    """This pipeline stage's layer specs following ``linear_attention_freq`` (1 = Gated DeltaNet)."""
    mlp, fused_mlp = _mlp_spec(config, backend)
    layers = []
    for is_linear in config.linear_attention_freq:
        mixer, fused_in = (_gated_delta_net_spec if is_linear else _attention_spec)(backend)
        layers.append(ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=IdentityOp if fused_in else _norm(backend),
                self_attention=mixer,
                self_attn_bda=get_bias_dropout_add,
                pre_mlp_layernorm=IdentityOp if fused_mlp else _norm(backend),
                mlp=mlp,
                mlp_bda=get_bias_dropout_add,
            ),
        ))
    return TransformerBlockSubmodules(layer_specs=[layers[i] for i in local_layer_ids(config, vp_stage, pp_rank)],
                                      layer_norm=_norm(backend))
