"""One decode step: every sample's next token(s) through the model against its ``DecodeState``."""

from typing import Optional

import torch

from megatron_longstraw.core.binding import DecodeBinding, bind
from megatron_longstraw.core.decode_state import DecodeState
from megatron_longstraw.longstraw.model_steps import decode, output_logits
from megatron_longstraw.longstraw.pipeline import check_pipeline, run_stages
from megatron_longstraw.models.pipeline_stage import last_chunk


@torch.no_grad()
def decode_step(model, state: DecodeState, ids_BS: torch.Tensor) -> Optional[torch.Tensor]:
    """Feed ``ids_BS`` (``[samples, s]``, usually ``s = 1``) at positions ``state.position...``.

    Each layer attends over the shared prompt state, the sample's earlier tokens and the new
    tokens (causally), appends the new tokens to the sample's state and advances it. Returns the
    logits ``[b, vocab / tp]`` predicting the token after the last fed one (this rank's
    vocabulary shard when the model keeps its output parallel). Under sequence parallelism the
    layers see the tokens padded to a multiple of TP and decode only the first ``seq`` rows.
    Under pipeline parallelism every stage calls it with the same tokens; the hidden states pass
    stage to stage and only the last stage returns logits (the others ``None``).
    """
    batch, seq = ids_BS.shape
    assert batch == state.num_samples, (batch, state.num_samples)
    state.check_room(seq)
    offset = state.position
    check_pipeline(model)
    with bind(model, DecodeBinding(position_offset=offset, valid_length=seq), state):
        hidden_SBH = run_stages(model, ids_BS, offset, lambda part, h: decode(part, h, offset))
    state.advance(seq)
    return None if hidden_SBH is None else output_logits(last_chunk(model), hidden_SBH[-1:])[0]
