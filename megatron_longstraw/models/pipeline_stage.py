"""Which decoder layers this pipeline stage builds (Megatron's layout or even split)."""

from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset


def local_layer_ids(config: TransformerConfig, vp_stage=None, pp_rank=None) -> list[int]:
    """Global indices of the layers on this (virtual) pipeline stage, as Megatron assigns them."""
    if config.pipeline_model_parallel_layout is not None:
        return list(config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank))
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return list(range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)))
