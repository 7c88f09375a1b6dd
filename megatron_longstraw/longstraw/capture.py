"""Prompt capture: one no-grad pass over the prompt in chunks, keeping only the prompt state.

One chunk loop serves every layout. The prompt is cut by ``collectives.shard_plan`` into chunks
and every chunk into one shard per context-parallel rank; without CP the plan has one shard per
chunk (the chunk itself). Each rank feeds its shard of every chunk through its pipeline stages
(``pipeline.run_stages``, which is the plain decoder stack without PP); the stateful layers
append to / update their state from the binding (``core/binding.py``).
"""

from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_longstraw.core.binding import CaptureBinding, bind, model_signature, stateful_modules
from megatron_longstraw.core.collectives import broadcast_from_last, context_parallel_group, shard_plan
from megatron_longstraw.core.state import PromptState
from megatron_longstraw.longstraw.expert_lockstep import ExpertLockstep
from megatron_longstraw.longstraw.model_steps import FinalNormInput, decode, output_logits, sequence_parallel
from megatron_longstraw.longstraw.pipeline import check_pipeline, run_stages
from megatron_longstraw.models.fp8 import prepare_forward
from megatron_longstraw.models.norms import fused_without_autograd
from megatron_longstraw.models.pipeline_stage import last_chunk


def check_context_parallel_support(model) -> None:
    """``ValueError`` naming the first stateful layer kind that cannot shard its prompt state."""
    cp = parallel_state.get_context_parallel_world_size()
    for name, module in stateful_modules(model).items():
        if not getattr(module, "supports_context_parallel", False):
            raise ValueError(
                f"--context-parallel-size {cp}: layer kind {type(module).__name__} ({name}) cannot "
                "shard its prompt state over the CP group yet; CP capture/replay supports full "
                "attention (SDPACoreAttention), Gated DeltaNet (Qwen3.5) and MLA + DSA (GLM-5)")


def _check_layout(model, batch: int, cp_group) -> None:
    """``ValueError`` for a layout the capture cannot run (CP with SP or with a prompt batch > 1)."""
    check_pipeline(model)
    if cp_group is None:
        return
    cp = dist.get_world_size(cp_group)
    check_context_parallel_support(model)
    if sequence_parallel(model):  # its padded sequence shards are not handled by the CP paths
        raise ValueError(f"--sequence-parallel with --context-parallel-size {cp} > 1 is not supported "
                         "by LongStraw capture/replay yet")
    if batch != 1:
        raise ValueError(f"--context-parallel-size {cp}: capture needs a prompt batch of 1, got {batch}")


@torch.no_grad()
def capture_prompt(model, prompt_ids_BS: torch.Tensor, chunk_size: int,
                   progress: Optional[Callable[[int], object]] = None, exact: bool = False) -> PromptState:
    """Run ``prompt_ids_BS`` through ``model`` without autograd, ``chunk_size`` tokens at a time.

    Each chunk attends to the state captured so far plus itself causally; recurrent layers carry
    their state from chunk to chunk. Peak memory is the state plus one chunk's activations.
    Returns the prompt state with the last position's hidden state and next-token logits.
    ``progress``, if given, is called with the number of tokens of each finished chunk.
    ``exact`` (``--prompt-gradient exact``): the layers also keep what the reverse sweep
    (``prompt_backward.py``) starts each chunk from (a recurrent layer's state at every chunk start).

    Context parallelism: every CP rank calls it with the same whole prompt (batch 1) and keeps
    its shard of every chunk (``core/collectives.py``); the Gated DeltaNet state after the prompt
    is replicated, and the last position's hidden state and logits are broadcast from the last
    CP rank. Pipeline parallelism: every stage calls it and keeps the state of its own layers;
    the first stage embeds each chunk, every stage runs its layers and hands the chunk's hidden
    states on (only chunk activations cross stages), and only the last stage's state holds the
    last position's hidden state and logits. Expert parallelism across data-parallel ranks: the
    ranks' chunk counts may differ; ``expert_lockstep.ExpertLockstep`` keeps their MoE
    all-to-alls matched.
    """
    if prompt_ids_BS.dim() != 2 or prompt_ids_BS.shape[1] == 0:
        raise ValueError(f"prompt must be [batch, tokens] with at least one token, got {tuple(prompt_ids_BS.shape)}")
    if chunk_size < 1:
        raise ValueError(f"--prompt-chunk-size must be >= 1, got {chunk_size}")
    batch, length = prompt_ids_BS.shape
    if length > model.max_sequence_length:
        raise ValueError(f"prompt of {length} tokens exceeds the model's {model.max_sequence_length} positions")
    # FP8: the weights are cast for this capture; delayed scaling's first forward (models/fp8.py)
    prepare_forward(model, lambda: capture_prompt(model, prompt_ids_BS[:, :chunk_size], chunk_size))
    cp_group = context_parallel_group()
    _check_layout(model, batch, cp_group)
    cp, rank = (1, 0) if cp_group is None else (dist.get_world_size(cp_group), dist.get_rank(cp_group))
    plan = shard_plan(length, chunk_size, cp)
    device = prompt_ids_BS.device
    state = PromptState(prompt_length=length, batch=batch, model_signature=model_signature(model),
                        chunk_starts=tuple(start + sum(sizes[:rank]) for start, sizes in plan))
    local_length = sum(sizes[rank] for _, sizes in plan)
    for name, module in stateful_modules(model).items():
        state.layers[name] = module.new_prompt_state(local_length, batch, device)
        if cp_group is not None and hasattr(state.layers[name], "positions_P"):  # DSA: global positions
            state.layers[name].positions_P = torch.cat([
                torch.arange(start + sum(sizes[:rank]), start + sum(sizes[:rank + 1]), device=device)
                for start, sizes in plan])
    last_stage = parallel_state.is_pipeline_last_stage()
    final_norm = FinalNormInput(last_chunk(model)) if last_stage else None
    lockstep = ExpertLockstep(model)  # EP over data-parallel ranks: their prompts differ in length
    with fused_without_autograd():  # the fused RMSNorm kernels (models/norms.py)
        try:
            for chunk_start, sizes in plan:
                start = chunk_start + sum(sizes[:rank])
                shard_ids_BS = prompt_ids_BS[:, start:start + sizes[rank]]
                lockstep.busy()
                with bind(model, CaptureBinding(position_offset=start, valid_length=sizes[rank],
                                                shard_sizes=None if cp_group is None else sizes, exact=exact), state):
                    hidden_SBH = run_stages(model, shard_ids_BS, start, lambda part, h: decode(part, h, start))
                if progress is not None:
                    progress(sum(sizes))
            lockstep.finish()
        finally:
            if final_norm is not None:
                final_norm.remove()
    if last_stage:  # the final norm's input at the last prompt token, and the next-token logits
        last_hidden_1BH = final_norm.last_row_1BH(hidden_SBH.shape[0])
        last_logits_BV = output_logits(last_chunk(model), hidden_SBH[-1:])[0]
        if cp_group is not None:  # the prompt's last token is on the last CP rank
            last_hidden_1BH = broadcast_from_last(last_hidden_1BH, cp_group)
            last_logits_BV = broadcast_from_last(last_logits_BV, cp_group)
        state.last_hidden_1BH, state.last_logits_BV = last_hidden_1BH, last_logits_BV
    return state
