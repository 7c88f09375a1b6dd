"""Response replay: forward of response tokens against the detached prompt state, with autograd."""

from typing import Sequence

import torch

from megatron_longstraw.core.binding import ReplayBinding, bind
from megatron_longstraw.core.state import PromptState
from megatron_longstraw.core.state_grad import read_with_grad
from megatron_longstraw.longstraw.micro_batches import LossFn, micro_batches
from megatron_longstraw.longstraw.model_steps import decode, embed, loss_of, output_logits, predicting_hidden
from megatron_longstraw.longstraw.pipeline import pipeline_parallel, replay_responses_pp
from megatron_longstraw.models.fp8 import calibrate_gradient_scales, gradient_scales_uncalibrated

def replay_logits(model, state: PromptState, response_ids_BR: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """Logits ``[r, b, vocab/tp]`` predicting each response token, with autograd."""
    return output_logits(model, replay_hidden(model, state, response_ids_BR, exact))


def replay_hidden(model, state: PromptState, response_ids_BR: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """Final hidden states ``[r, b, h]`` predicting each response token, with autograd.

    Row 0 comes from the prompt's last position (final norm with grad, the hidden state
    detached); rows 1.. from the response's own positions. ``exact`` (``--prompt-gradient
    exact``): the prompt state is read with gradients into its buffers (``core/state_grad.py``),
    the last position's hidden state too.
    """
    batch, length = response_ids_BR.shape
    if state.batch != 1 and state.batch != batch:
        raise ValueError(f"prompt state of batch {state.batch} cannot serve {batch} responses")
    if state.prompt_length + length > model.max_sequence_length:
        raise ValueError(
            f"response of {length} tokens after a {state.prompt_length}-token prompt exceeds the "
            f"model's {model.max_sequence_length} positions")
    offset = state.prompt_length
    with bind(model, ReplayBinding(position_offset=offset, exact=exact), state):
        hidden_SBH = decode(model, embed(model, response_ids_BR, offset), offset)
    last_hidden_1BH = state.last_hidden_1BH
    if exact:
        last_hidden_1BH = read_with_grad(last_hidden_1BH, state.last_hidden_grad())
    return predicting_hidden(model, last_hidden_1BH, hidden_SBH)


def replay_responses(model, state: PromptState, responses: Sequence[torch.Tensor], loss_fn: LossFn,
                     micro_batch_size: int = 1, exact: bool = False) -> list[float]:
    """Replay ``responses`` ``micro_batch_size`` at a time; backward after each micro-batch.

    Gradients accumulate in the parameters; each micro-batch's graph is freed before the next.
    Returns each micro-batch's loss. ``exact``: the gradients with respect to the prompt state
    accumulate in its buffers too, for ``prompt_backward.prompt_backward`` after the group.
    """
    if micro_batch_size < 1:
        raise ValueError(f"--replay-micro-batch-size must be >= 1, got {micro_batch_size}")
    if gradient_scales_uncalibrated(model):  # FP8 delayed scaling: a model's first backward (models/fp8.py)
        calibrate_gradient_scales(model, lambda: replay_responses(
            model, state, responses[:micro_batch_size], loss_fn, micro_batch_size))
    if pipeline_parallel():  # Megatron's schedule, one micro-batch per micro_batch_size responses
        return replay_responses_pp(model, state, responses, loss_fn, micro_batch_size, exact=exact)
    losses = []
    for ids_BR, mask_RB, indices in micro_batches(responses, micro_batch_size):
        # backward inside the binding: recomputed layers re-run forward against the state
        with bind(model, ReplayBinding(position_offset=state.prompt_length, exact=exact), state):
            loss = loss_of(loss_fn, model, replay_hidden(model, state, ids_BR, exact), ids_BR, mask_RB, indices)
            loss.backward()
        losses.append(loss.item())
    return losses
