"""Which decoder layers this pipeline stage builds (Megatron's layout or even split), and the
container of a rank's model chunks under virtual pipeline stages."""

import torch
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


def chunk_layer_ids(model) -> list[int]:
    """Global indices of the layers of ``model``, one model chunk (its ``vp_stage`` under virtual
    pipeline stages)."""
    return local_layer_ids(model.config, vp_stage=getattr(model, "vp_stage", None))


class StageChunks(torch.nn.ModuleList):
    """This rank's model chunks under virtual pipeline stages (Megatron's interleaved layout):
    chunk ``v`` holds the layers of virtual stage ``v x PP + rank``, so a token passes every
    rank's chunk 0, then every rank's chunk 1, and so on.

    LongStraw treats it as this rank's model: its stateful modules have unique names
    (``0.decoder.layers.0...``), so one ``PromptState`` holds every chunk's state and ``bind``
    binds them all; ``pipeline.run_stages`` runs the chunks in turn; Megatron's interleaved
    schedule and optimizer take ``list(chunks)``. What does not depend on the chunk (the config,
    the vocabulary, the position budget) is read from the first.
    """

    @property
    def config(self):
        return self[0].config

    @property
    def hf_config(self) -> dict:
        return self[0].hf_config

    @property
    def max_sequence_length(self) -> int:
        return self[0].max_sequence_length

    @property
    def vocab_size(self) -> int:
        return self[0].vocab_size

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """Every chunk's Megatron sharded state dict, keyed as ``state_dict()`` keys them
        (``{prefix}{v}.{name}``). The checkpoint's tensors are named by global layer number, so
        Megatron's distributed checkpointing reshards between layouts (tested: PP=2 x 2 virtual
        stages -> PP=1, ``tests/test_train_grpo.py``)."""
        out = {}
        for v, chunk in enumerate(self):
            for key, value in chunk.sharded_state_dict(prefix, sharded_offsets, metadata).items():
                out[f"{prefix}{v}.{key.removeprefix(prefix)}"] = value
        return out


def model_chunks(model) -> list:
    """The model chunks of this rank, in virtual-stage order (``[model]`` without virtual stages)."""
    return list(model) if isinstance(model, StageChunks) else [model]


def last_chunk(model):
    """The chunk that ends this rank's part of the model (holds the final norm and output layer
    on the last pipeline stage)."""
    return model_chunks(model)[-1]
