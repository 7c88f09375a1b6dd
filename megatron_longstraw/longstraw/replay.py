"""Response replay: forward of response tokens against the detached prompt state, with autograd."""

from typing import Callable, Sequence

import torch

from megatron_longstraw.longstraw.binding import Mode, bind
from megatron_longstraw.longstraw.model_steps import decode, embed, loss_of, output_logits, predicting_hidden
from megatron_longstraw.longstraw.pipeline import pipeline_parallel, replay_responses_pp
from megatron_longstraw.longstraw.state import PromptState
from megatron_longstraw.models.fp8 import calibrate_gradient_scales, gradient_scales_uncalibrated

# loss_fn(logprobs_RB, mask_RB, sample_indices) -> scalar; summed over micro-batches, so it must be
# a sum of per-sample terms with any normalization fixed for the whole group. A loss with a true
# ``needs_entropy`` attribute is also given ``entropy_RB=`` (see ``model_steps.loss_of``).
LossFn = Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor]


def pad_responses(responses: Sequence[torch.Tensor], pad_id: int = 0):
    """Right-pad 1-D token tensors into ``ids_BR`` and a float ``mask_RB`` of real tokens."""
    if not responses or any(r.dim() != 1 or r.numel() == 0 for r in responses):
        raise ValueError("every response must be a non-empty 1-D token tensor")
    length = max(r.numel() for r in responses)
    ids_BR = responses[0].new_full((len(responses), length), pad_id)
    mask_RB = torch.zeros(length, len(responses), device=responses[0].device)
    for i, r in enumerate(responses):
        ids_BR[i, : r.numel()] = r
        mask_RB[: r.numel(), i] = 1.0
    return ids_BR, mask_RB


def replay_logits(model, state: PromptState, response_ids_BR: torch.Tensor) -> torch.Tensor:
    """Logits ``[r, b, vocab/tp]`` predicting each response token, with autograd."""
    return output_logits(model, replay_hidden(model, state, response_ids_BR))


def replay_hidden(model, state: PromptState, response_ids_BR: torch.Tensor) -> torch.Tensor:
    """Final hidden states ``[r, b, h]`` predicting each response token, with autograd.

    Row 0 comes from the prompt's last position (final norm with grad, the hidden state
    detached); rows 1.. from the response's own positions.
    """
    batch, length = response_ids_BR.shape
    if state.batch != 1 and state.batch != batch:
        raise ValueError(f"prompt state of batch {state.batch} cannot serve {batch} responses")
    if state.prompt_length + length > model.max_sequence_length:
        raise ValueError(
            f"response of {length} tokens after a {state.prompt_length}-token prompt exceeds the "
            f"model's {model.max_sequence_length} positions")
    offset = state.prompt_length
    with bind(model, Mode.REPLAY, state, position_offset=offset):
        hidden_SBH = decode(model, embed(model, response_ids_BR, offset), offset)
    return predicting_hidden(model, state.last_hidden_1BH, hidden_SBH)


def replay_responses(model, state: PromptState, responses: Sequence[torch.Tensor], loss_fn: LossFn,
                     micro_batch_size: int = 1) -> list[float]:
    """Replay ``responses`` ``micro_batch_size`` at a time; backward after each micro-batch.

    Gradients accumulate in the parameters; each micro-batch's graph is freed before the next.
    Returns each micro-batch's loss.
    """
    if micro_batch_size < 1:
        raise ValueError(f"--replay-micro-batch-size must be >= 1, got {micro_batch_size}")
    if gradient_scales_uncalibrated(model):  # FP8 delayed scaling: a model's first backward (models/fp8.py)
        calibrate_gradient_scales(model, lambda: replay_responses(
            model, state, responses[:micro_batch_size], loss_fn, micro_batch_size))
    if pipeline_parallel():  # Megatron's schedule, one micro-batch per micro_batch_size responses
        return replay_responses_pp(model, state, responses, loss_fn, micro_batch_size)
    losses = []
    for start in range(0, len(responses), micro_batch_size):
        indices = list(range(start, min(start + micro_batch_size, len(responses))))
        ids_BR, mask_RB = pad_responses([responses[i] for i in indices])
        # backward inside the binding: recomputed layers re-run forward against the state
        with bind(model, Mode.REPLAY, state, position_offset=state.prompt_length):
            loss = loss_of(loss_fn, model, replay_hidden(model, state, ids_BR), ids_BR, mask_RB, indices)
            loss.backward()
        losses.append(loss.item())
    return losses
