"""Pipeline parallelism for LongStraw: capture stage by stage, replay through Megatron's schedule.

Each pipeline stage builds only its own layers (``models/pipeline_stage.py``), so it keeps the
prompt state of those layers only.

- Capture (``capture.capture_prompt``, no autograd): chunk by chunk through ``run_stages``; the
  last stage keeps the final norm's input at the last prompt token and the next-token logits.
- ``replay_responses_pp`` (autograd): Megatron's ``get_forward_backward_func()`` schedule with
  one micro-batch per ``micro_batch_size`` responses; the forward step runs this stage's layers
  bound to this stage's prompt state (the binding spans the whole schedule, so backward and any
  recomputation see it too); the last stage computes the loss. Responses are padded to one length
  so that every micro-batch has the shape the schedule's point-to-point transfers expect. With
  ``exact`` (``--prompt-gradient exact``) each stage reads its layers' state with gradients into
  their buffers, the last stage the prompt's last hidden state too.
- ``prompt_backward_pp`` (autograd): ``prompt_backward.prompt_backward``'s reverse sweep, one
  schedule call per capture chunk, last chunk first (a chunk's backward must follow those of the
  later chunks, which add into its state's gradients): every stage recomputes its layers on the
  chunk and backpropagates, in one backward, the gradient from the next stage together with the
  accumulated gradients of its own layers' state entries of the chunk (``_WithInjected``).
- ``run_stages`` (no autograd): one slice of tokens through the stages, as capture passes a chunk;
  decoding (``decode_step``) and the trainer's scoring (``score_logprobs_pp``) use it, the last
  stage computing logits and log-probs. Whatever only the last stage computes (sampled tokens,
  a group's metrics) reaches the other stages with ``from_last_stage``.

With context parallelism the same capture loop passes each stage's CP shard of every chunk on
through ``run_stages``; replay, scoring and decoding are these functions unchanged, and the
reverse sweep's schedule call takes each stage's CP shard of the chunk (``prompt_backward_pp``).
Under sequence parallelism the stages pass the whole slice too (as every model step's interface
is), each stage's decoder running on its TP rank's shard of it.

Virtual pipeline stages (``--num-virtual-stages-per-pipeline-rank``): the rank's model is a
``models.pipeline_stage.StageChunks``; ``run_stages`` takes each slice around the ring of ranks
once per chunk, and replay runs through Megatron's interleaved schedule (one data iterator per
chunk, micro-batches padded to a multiple of PP); with CP and TP + SP as without them. The
reverse sweep pads its one micro-batch per call with PP - 1 that only pass zeros through.
"""

import contextlib
from typing import Callable, ContextManager, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_longstraw.core.binding import ReplayBinding, SweepBinding, bind
from megatron_longstraw.core.collectives import context_parallel_group, sweep_chunks
from megatron_longstraw.core.state import PromptState
from megatron_longstraw.core.state_grad import SweepTargets, read_with_grad
from megatron_longstraw.longstraw.micro_batches import micro_batches, uniform_micro_batches
from megatron_longstraw.longstraw.model_steps import (
    FinalNormInput, decode, embed, loss_of, predicting_hidden, response_logprobs, sequence_parallel)
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
        with bind(model, ReplayBinding(position_offset=offset), state):
            hidden_SBH = run_stages(model, ids_BR, offset, lambda part, h: decode(part, h, offset))
        if hidden_SBH is None:
            out.extend(torch.zeros(r.numel(), device=r.device) for r in chunk)
            continue
        tail = last_chunk(model)
        logprobs_RB = response_logprobs(tail, predicting_hidden(tail, state.last_hidden_1BH, hidden_SBH),
                                        ids_BR.t())
        out.extend(logprobs_RB[: r.numel(), i].float() for i, r in enumerate(chunk))
    return out


def _run_schedule(model, forward_step, batches: list, length: int, micro_batch_size: int) -> None:
    """Megatron's ``get_forward_backward_func()`` schedule over ``batches`` (one micro-batch each,
    every one ``length`` tokens of ``micro_batch_size`` rows; under virtual stages one data
    iterator per chunk), each micro-batch's loss taken as it is (already normalized)."""
    chunks = model_chunks(model)
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
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches),
            model=chunks, num_microbatches=len(batches), seq_length=length * shards,
            micro_batch_size=micro_batch_size, forward_only=False)
    finally:
        for config, value in zip(configs, saved):
            config.calculate_per_token_loss = value


def replay_responses_pp(model, state: PromptState, responses: Sequence[torch.Tensor], loss_fn,
                        micro_batch_size: int = 1, exact: bool = False) -> list[float]:
    """``replay_responses`` through Megatron's pipeline schedule (same arguments); every stage
    calls it with the same responses. Gradients accumulate in this stage's parameters (with
    ``exact``, those of this stage's prompt state in its buffers too); returns each micro-batch's
    loss on the last stage, an empty list elsewhere."""
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
        last_hidden_1BH = state.last_hidden_1BH
        if exact:  # the prompt's last hidden state, read by every response, with its gradient
            last_hidden_1BH = read_with_grad(last_hidden_1BH, state.last_hidden_grad())
        hidden_SBH = predicting_hidden(chunk, last_hidden_1BH, hidden_SBH)

        def loss_func(output_SBH):
            real = len(indices)
            if real == 0:  # a padding micro-batch
                return output_SBH.sum() * 0.0, torch.ones((), dtype=torch.int), {}
            loss = loss_of(loss_fn, chunk, output_SBH[:, :real], ids_BR[:real], mask_RB[:, :real], indices)
            losses.append(loss.item())
            return loss, torch.ones((), dtype=torch.int), {}
        return hidden_SBH, loss_func

    with bind(model, ReplayBinding(position_offset=offset, exact=exact), state):
        _run_schedule(model, forward_step, batches, length, micro_batch_size)
    return losses


class _WithInjected(torch.autograd.Function):
    """Identity on a stage's output; its backward passes the output's gradient on and hands each
    injected tensor (``SweepTargets``: the stage's own state entries of the chunk) its gradient,
    so that both enter the stage's one backward."""

    @staticmethod
    def forward(ctx, output, grads, *injected):
        ctx.grads = grads
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        return (grad, None, *ctx.grads)


def prompt_backward_pp(model, state: PromptState, prompt_ids_BS: torch.Tensor,
                       chunk_context: Optional[Callable[[int], ContextManager]] = None) -> None:
    """``prompt_backward.prompt_backward`` (same arguments; its checks done) through Megatron's
    pipeline schedule: per capture chunk, last first, one schedule call with one micro-batch (the
    chunk; under virtual stages with PP - 1 padding micro-batches that pass zeros through). The
    first stage embeds the chunk; every stage recomputes its layers (``SweepBinding``) and joins
    what its layers injected (and, on the last stage, the final norm's input at the prompt's last
    position) to its output, whose backward the schedule runs with the next stage's gradient.
    Every stage calls it; parameter gradients accumulate in this stage's parameters.

    Under CP the micro-batch is this rank's shard of the chunk (``collectives.sweep_chunks``),
    the layers' collectives with backward pairing up over the stage's CP group; the last stage
    injects the final norm's input on every CP rank in every chunk (its gradient zero but on the
    last CP rank in the last chunk), so that every CP rank backpropagates every layer. The sum
    over CP around it is the caller's (``prompt_backward.prompt_backward``)."""
    check_pipeline(model)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if state.batch != 1:
        raise ValueError(f"pipeline-parallel prompt backward needs a prompt state of batch 1, got {state.batch}")
    chunks = model_chunks(model)
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    hidden_size, dtype = model.config.hidden_size, model.config.pipeline_dtype
    cp_group = context_parallel_group()
    spans = sweep_chunks(state, cp_group)  # under CP this rank's shard of every chunk
    # under CP the prompt's last position is on the last CP rank
    last_rank = cp_group is None or dist.get_rank(cp_group) == cp_group.size() - 1
    for index in reversed(range(len(spans))):
        start, end, shard_sizes, local_offset = spans[index]
        targets = SweepTargets()
        injects_last = last and last_rank and index == len(spans) - 1
        # under CP the last stage's backward starts at the final norm's input in every chunk (a zero
        # gradient but at the prompt's last position), so that every CP rank backpropagates every
        # layer and the layers' backward collectives pair up
        final_norm = (FinalNormInput(last_chunk(model), keep_graph=True)
                      if last and (injects_last or cp_group is not None) else None)
        # the interleaved schedule runs micro-batches in groups of PP per chunk
        batches = [True] + [False] * ((pp - 1) if len(chunks) > 1 else 0)

        def forward_step(data_iterator, chunk, start=start, end=end, targets=targets, final_norm=final_norm,
                         injects_last=injects_last):
            real = next(data_iterator)
            v = chunks.index(chunk)
            embeds, ends_model = first and v == 0, last and v == len(chunks) - 1
            if not real:  # a padding micro-batch: zeros through every stage, no loss, no gradient
                hidden_SBH = (torch.zeros((end - start, 1, hidden_size), dtype=dtype, device=prompt_ids_BS.device,
                                          requires_grad=True) if embeds else chunk.decoder.input_tensor)
                if not ends_model:
                    return hidden_SBH.view_as(hidden_SBH), None
                return hidden_SBH, lambda out_SBH: (out_SBH.sum() * 0.0, torch.ones((), dtype=torch.int), {})
            mark = len(targets.outputs)
            hidden_SBH = embed(chunk, prompt_ids_BS[:, start:end], start) if embeds else chunk.decoder.input_tensor
            hidden_SBH = decode(chunk, hidden_SBH, start)
            if final_norm is not None and ends_model:  # read by every response
                targets.inject_reaching(final_norm.last_row_1BH(end - start),
                                        state.last_hidden_grad_1BH if injects_last else None)
            injected, grads = targets.take(mark)
            if not ends_model:
                return _WithInjected.apply(hidden_SBH, tuple(grads), *injected), None
            # the last stage: a zero "loss" whose backward is the injected gradients' (tied to the
            # output when nothing is injected, so that the previous stage still gets its gradient)
            carrier = hidden_SBH.new_zeros(()) if injected else hidden_SBH.sum() * 0.0
            loss = _WithInjected.apply(carrier, tuple(grads), *injected)
            return hidden_SBH, lambda _: (loss, torch.ones((), dtype=torch.int), {})

        around = chunk_context(index) if chunk_context is not None else contextlib.nullcontext()
        try:
            binding = SweepBinding(position_offset=start, valid_length=end - start, targets=targets,
                                   shard_sizes=shard_sizes, local_offset=local_offset)
            with around, torch.enable_grad(), bind(model, binding, state):
                _run_schedule(model, forward_step, batches, end - start, 1)
                assert not targets.outputs, "every injected tensor went in with its stage's output"
                targets.backward()  # nothing left to backpropagate: the layers' after-backward steps
        finally:
            if final_norm is not None:
                final_norm.remove()
