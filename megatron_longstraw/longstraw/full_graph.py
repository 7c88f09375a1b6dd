"""The full-graph baseline (``--replay-mode full``): each response trained on prompt + response.

Same model, kernels and loss as LongStraw, with the same stop-gradient semantics: the tensors
that form the prompt state (K/V, recurrent-state inputs, the final-norm input at prompt rows)
are detached (``ReferenceBinding``). Memory and time then scale with the prompt per response; use
activation recompute (``--recompute-granularity full``) for long prompts. It is the reference
for the capture/replay tests and the comparison for the benchmark.
"""

from typing import Sequence

import torch

from megatron_longstraw.core.binding import ReferenceBinding, bind
from megatron_longstraw.longstraw.micro_batches import LossFn, micro_batches
from megatron_longstraw.longstraw.model_steps import (
    FinalNormInput, decode, embed, loss_of, output_logits)
from megatron_longstraw.models.fp8 import calibrate_gradient_scales, gradient_scales_uncalibrated, prepare_forward


def full_graph_logits(model, prompt_ids_1S: torch.Tensor, response_ids_BR: torch.Tensor,
                      exact: bool = False) -> torch.Tensor:
    """Logits ``[r, b, vocab/tp]`` predicting each response token from one full forward."""
    return output_logits(model, full_graph_hidden(model, prompt_ids_1S, response_ids_BR, exact))


def full_graph_hidden(model, prompt_ids_1S: torch.Tensor, response_ids_BR: torch.Tensor,
                      exact: bool = False) -> torch.Tensor:
    """Final hidden states ``[r, b, h]`` predicting each response token from one full forward;
    ``exact`` (``--prompt-gradient exact``): nothing detached, ordinary backprop through prompt
    and response."""
    prompt_length = prompt_ids_1S.shape[1]
    detached = 0 if exact else prompt_length
    batch = response_ids_BR.shape[0]
    ids_BS = torch.cat([prompt_ids_1S.expand(batch, -1), response_ids_BR], dim=1)
    final_norm = FinalNormInput(model, detach_rows=detached)
    try:
        with bind(model, ReferenceBinding(prefix_length=detached)):
            hidden_SBH = decode(model, embed(model, ids_BS, 0), 0)
    finally:
        final_norm.remove()
    return hidden_SBH[prompt_length - 1:-1]


def full_graph_responses(model, prompt_ids_1S: torch.Tensor, responses: Sequence[torch.Tensor],
                         loss_fn: LossFn, micro_batch_size: int = 1, exact: bool = False) -> list[float]:
    """Like ``replay_responses`` but each micro-batch runs prompt + responses with autograd
    (``exact``: with nothing detached, the reference of ``--prompt-gradient exact``)."""
    with torch.no_grad():  # FP8: weights cast for this pass; delayed scaling's first forward (models/fp8.py)
        prepare_forward(model, lambda: full_graph_hidden(model, prompt_ids_1S, responses[0][None]))
    if gradient_scales_uncalibrated(model):  # FP8 delayed scaling: a model's first backward (models/fp8.py)
        calibrate_gradient_scales(model, lambda: full_graph_responses(
            model, prompt_ids_1S, responses[:micro_batch_size], loss_fn, micro_batch_size))
    losses = []
    for ids_BR, mask_RB, indices in micro_batches(responses, micro_batch_size):
        # backward inside the binding: recomputed layers re-run forward with the same detaches
        with bind(model, ReferenceBinding(prefix_length=0 if exact else prompt_ids_1S.shape[1])):
            loss = loss_of(loss_fn, model, full_graph_hidden(model, prompt_ids_1S, ids_BR, exact), ids_BR, mask_RB,
                           indices)
            loss.backward()
        losses.append(loss.item())
    return losses
