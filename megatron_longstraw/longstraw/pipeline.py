"""Pipeline parallelism for LongStraw: capture stage by stage, replay through Megatron's schedule.

Each pipeline stage builds only its own layers (``models/pipeline_stage.py``), so it keeps the
prompt state of those layers only.

- Capture (``capture.capture_prompt``, no autograd): chunk by chunk through ``run_stages``; the
  last stage keeps the final norm's input at the last prompt token and the next-token logits.
- ``replay_responses_pp`` (autograd): Megatron's ``get_forward_backward_func()`` schedule with
  one micro-batch per ``micro_batch_size`` responses; the forward step runs this stage's layers
  bound to this stage's prompt state (the binding spans the whole schedule, so backward and any
  recomputation see it too); the last stage computes the loss. Responses are padded to one length
  so that every micro-batch has the shape the schedule's point-to-point transfers expect.
- ``run_stages`` (no autograd): one slice of tokens through the stages, as capture passes a chunk;
  decoding (``decode_step``) and the trainer's scoring (``score_logprobs_pp``) use it, the last
  stage computing logits and log-probs. Whatever only the last stage computes (sampled tokens,
  a group's metrics) reaches the other stages with ``from_last_stage``.

With context parallelism the same capture loop passes each stage's CP shard of every chunk on
through ``run_stages``; replay, scoring and decoding are these
functions unchanged. Under sequence parallelism the stages pass the whole slice too (as every
model step's interface is), each stage's decoder running on its TP rank's shard of it.

Virtual pipeline stages (``--num-virtual-stages-per-pipeline-rank``): the rank's model is a
``models.pipeline_stage.StageChunks``; ``run_stages`` takes each slice around the ring of ranks
once per chunk, and replay runs through Megatron's interleaved schedule (one data iterator per
chunk, micro-batches padded to a multiple of PP); with CP and TP + SP as without them.
"""

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_longstraw.core.binding import Mode, bind
from megatron_longstraw.core.state import PromptState
from megatron_longstraw.longstraw.micro_batches import micro_batches, uniform_micro_batches
from megatron_longstraw.longstraw.model_steps import (
    decode, embed, loss_of, predicting_hidden, response_logprobs, sequence_parallel)
from megatron_longstraw.models.pipeline_stage import last_chunk, model_chunks


def pipeline_parallel() -> bool:
    """Whether Megatron's pipeline-parallel size is above 1."""
    return parallel_state.get_pipeline_model_parallel_world_size() > 1


def check_pipeline(model) -> None:
    """Invariant: under virtual pipeline stages ``model`` is this rank's ``StageChunks``."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    assert len(model_chunks(model)) == vpp, "under virtual pipeline stages the model is a StageChunks"


def _stage_input(model, shape, device) -> torch.Tensor:
    """The previous stage's hidden states (from the previous rank of the pipeline ring)."""
    hidden = torch.empty(shape, dtype=model.config.pipeline_dtype, device=device)
    dist.recv(hidden, parallel_state.get_pipeline_model_parallel_prev_rank())
    return hidden


def run_stages(model, ids_BS: torch.Tensor, offset: int,
               run: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]):
    """One slice of tokens at positions ``offset...`` through the pipeline: the first stage embeds
    ``ids_BS``, every stage applies ``run(chunk, hidden)`` (its layers, bound by the caller) to
    the previous stage's hidden states and sends the result on. Under virtual pipeline stages
    each rank does so for each of its chunks in turn (chunk ``v`` of the last rank hands on to
    chunk ``v + 1`` of the first: Megatron's ring of ranks). Returns the last stage's output
    ``[s, b, h]``, ``None`` on the other stages."""
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    chunks = model_chunks(model)
    batch, seq = ids_BS.shape
    for v, chunk in enumerate(chunks):
        embeds = first and v == 0
        if embeds:
            hidden_SBH = embed(chunk, ids_BS, offset)
        else:
            hidden_SBH = _stage_input(chunk, (seq, batch, chunk.config.hidden_size), ids_BS.device)
            chunk.set_input_tensor(hidden_SBH)
        try:
            hidden_SBH = run(chunk, hidden_SBH)
        finally:
            if not embeds:
                chunk.set_input_tensor(None)
        if last and v == len(chunks) - 1:
            return hidden_SBH
        dist.send(hidden_SBH.to(chunk.config.pipeline_dtype).contiguous(),
                  parallel_state.get_pipeline_model_parallel_next_rank())
    return None


def from_last_stage(value):
    """The last pipeline stage's ``value`` (a picklable object) on every stage."""
    box = [value]
    dist.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                               group=parallel_state.get_pipeline_model_parallel_group())
    return box[0]


@torch.no_grad()
def score_logprobs_pp(model, state: PromptState, responses: Sequence[torch.Tensor],
                      micro_batch_size: int) -> list[torch.Tensor]:
    """Per-response log-probs without a graph, through the stages ``micro_batch_size`` responses
    at a time, computed as replay computes them (row 0 from the prompt's last hidden state). The
    last stage returns them; the other stages get zeros of the responses' lengths (only the last
    stage evaluates the loss)."""
    check_pipeline(model)
    offset, out = state.prompt_length, []
    for ids_BR, _, indices in micro_batches(responses, micro_batch_size):
        chunk = [responses[i] for i in indices]
        with bind(model, Mode.REPLAY, state, position_offset=offset):
            hidden_SBH = run_stages(model, ids_BR, offset, lambda part, h: decode(part, h, offset))
        if hidden_SBH is None:
            out.extend(torch.zeros(r.numel(), device=r.device) for r in chunk)
            continue
        tail = last_chunk(model)
        logprobs_RB = response_logprobs(tail, predicting_hidden(tail, state.last_hidden_1BH, hidden_SBH),
                                        ids_BR.t())
        out.extend(logprobs_RB[: r.numel(), i].float() for i, r in enumerate(chunk))
    return out


def replay_responses_pp(model, state: PromptState, responses: Sequence[torch.Tensor], loss_fn,
                        micro_batch_size: int = 1) -> list[float]:
    """``replay_responses`` through Megatron's pipeline schedule (same arguments); every stage
    calls it with the same responses. Gradients accumulate in this stage's parameters; returns
    each micro-batch's loss on the last stage, an empty list elsewhere."""
    check_pipeline(model)
    if state.batch != 1:
        raise ValueError(f"pipeline-parallel replay needs a prompt state of batch 1, got {state.batch}")
    batches = uniform_micro_batches(responses, micro_batch_size)
    length = batches[0][0].shape[1]
    if state.prompt_length + length > model.max_sequence_length:
        raise ValueError(f"response of {length} tokens after a {state.prompt_length}-token prompt exceeds the "
                         f"model's {model.max_sequence_length} positions")
    chunks = model_chunks(model)
    if len(chunks) > 1:
        # Megatron's interleaved schedule runs micro-batches in groups of PP per chunk: pad the
        # count to a multiple of PP with micro-batches of empty rows (no loss, no gradient)
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        ids_BR, mask_RB, _ = batches[-1]
        batches += [(ids_BR.new_zeros(ids_BR.shape), mask_RB.new_zeros(mask_RB.shape), [])] * (-len(batches) % pp)
    offset, losses = state.prompt_length, []
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()

    def forward_step(data_iterator, chunk):
        ids_BR, mask_RB, indices = next(data_iterator)
        v = chunks.index(chunk)
        hidden_SBH = embed(chunk, ids_BR, offset) if first and v == 0 else chunk.decoder.input_tensor
        hidden_SBH = decode(chunk, hidden_SBH, offset)
        if not (last and v == len(chunks) - 1):
            return hidden_SBH, None
        hidden_SBH = predicting_hidden(chunk, state.last_hidden_1BH, hidden_SBH)

        def loss_func(output_SBH):
            real = len(indices)
            if real == 0:  # a padding micro-batch
                return output_SBH.sum() * 0.0, torch.ones((), dtype=torch.int), {}
            loss = loss_of(loss_fn, chunk, output_SBH[:, :real], ids_BR[:real], mask_RB[:, :real], indices)
            losses.append(loss.item())
            return loss, torch.ones((), dtype=torch.int), {}
        return hidden_SBH, loss_func

    # the schedule sizes its transfers as a sequence sharded over CP and, under sequence
    # parallelism, TP (length // cp // tp); what LongStraw's stages pass on is the whole slice on
    # every rank (model_steps: the decoder alone runs on sequence shards)
    shards = parallel_state.get_context_parallel_world_size() * (
        parallel_state.get_tensor_model_parallel_world_size() if sequence_parallel(model) else 1)
    configs = [chunk.config for chunk in chunks]
    saved = [config.calculate_per_token_loss for config in configs]
    for config in configs:  # the loss is already normalized: no division by micro-batches
        config.calculate_per_token_loss = True
    try:
        with bind(model, Mode.REPLAY, state, position_offset=offset):
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=[iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches),
                model=chunks, num_microbatches=len(batches), seq_length=length * shards,
                micro_batch_size=micro_batch_size, forward_only=False)
    finally:
        for config, value in zip(configs, saved):
            config.calculate_per_token_loss = value
    return losses
