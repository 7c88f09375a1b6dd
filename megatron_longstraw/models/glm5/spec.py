"""GLM-5's Megatron layer specs: absorbed MLA with DSA everywhere, a dense MLP or MoE per
``moe_layer_freq``, for the local or the Transformer Engine backend."""

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    _validate_dsa_index_share_pipeline_split,
)
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant.absorbed_mla import (
    AbsorbedMLASelfAttentionSubmodules,
)
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerSubmodules, DSAttentionSubmodules
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_longstraw.models.glm5.config import HF_LATENT_NORM_EPS
from megatron_longstraw.models.glm5.layers import (
    DuplicatedLinear,
    GlmAbsorbedMLASelfAttention,
    IndexerLayerNorm,
    LongStrawAbsorbedMLASelfAttention,
    LongStrawDSAIndexer,
    LongStrawDSAttention,
    fixed_eps_norm,
)
from megatron_longstraw.models.norms import RMSNorm
from megatron_longstraw.models.pipeline_stage import local_layer_ids


def attention_spec(config: TransformerConfig, backend) -> ModuleSpec:
    """``AbsorbedMLASelfAttention`` + ``DSAttention``/``DSAIndexer`` for the given backend.

    Transformer Engine: Megatron's ``get_dsa_module_spec_for_backend`` layout (duplicated
    ``TELinear`` down projections and indexer linears, ``TENorm``). Local: the same layout with
    ``DuplicatedLinear`` (through ``GlmAbsorbedMLASelfAttention``, see ``layers.py``) and the
    project's SP-aware ``RMSNorm``. The attention, core attention and indexer are the LongStraw
    subclasses (``layers.py``): Megatron's modules unless bound for capture/replay.
    """
    te = backend.fuse_layernorm_and_linear()
    if te:
        attention, duplicated = LongStrawAbsorbedMLASelfAttention, backend.linear()
        latent_norm = backend.layer_norm(rms_norm=True, for_qk=True)
        k_norm = backend.layer_norm(rms_norm=False, for_qk=True)
    else:
        attention, duplicated = GlmAbsorbedMLASelfAttention, DuplicatedLinear
        latent_norm, k_norm = RMSNorm, IndexerLayerNorm
    latent_norm = fixed_eps_norm(latent_norm, HF_LATENT_NORM_EPS)
    indexer = ModuleSpec(
        module=LongStrawDSAIndexer,
        submodules=DSAIndexerSubmodules(
            linear_wq_b=duplicated, linear_wk=duplicated, k_norm=k_norm,
            linear_weights_proj=duplicated,
        ),
    )
    return ModuleSpec(
        module=attention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=AbsorbedMLASelfAttentionSubmodules(
            linear_q_down_proj=duplicated,
            linear_q_up_proj=backend.column_parallel_linear(),
            linear_kv_down_proj=duplicated,
            linear_kv_up_proj=backend.column_parallel_linear(),
            core_attention=ModuleSpec(module=LongStrawDSAttention,
                                      submodules=DSAttentionSubmodules(indexer=indexer)),
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=latent_norm,
            kv_layernorm=latent_norm,
        ),
    )


def block_spec(config: TransformerConfig, backend, vp_stage=None, pp_rank=None) -> TransformerBlockSubmodules:
    """This pipeline stage's layer specs: DSA attention everywhere, dense MLP or MoE per
    ``moe_layer_freq``; norms are unfused RMSNorms (DSA needs the normed latents)."""
    te = backend.fuse_layernorm_and_linear()
    norm = backend.layer_norm(rms_norm=True) if te else RMSNorm
    attention = attention_spec(config, backend)
    dense = ModuleSpec(module=MLP, submodules=MLPSubmodules(
        linear_fc1=backend.column_parallel_linear(), linear_fc2=backend.row_parallel_linear()))
    moe = get_moe_module_spec_for_backend(backend, num_experts=config.num_moe_experts,
                                          moe_grouped_gemm=False)
    layers = [
        ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=moe if is_moe else dense,
            mlp_bda=get_bias_dropout_add,
        ))
        for is_moe in config.moe_layer_freq
    ]
    local_ids = local_layer_ids(config, vp_stage, pp_rank)
    _validate_dsa_index_share_pipeline_split(config, local_ids)
    return TransformerBlockSubmodules(layer_specs=[layers[i] for i in local_ids], layer_norm=norm)
