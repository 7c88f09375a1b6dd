"""Prompt capture: one no-grad pass over the prompt in chunks, keeping only the prompt state."""

from typing import Callable, Optional

import torch
from megatron.core import parallel_state

from megatron_longstraw.longstraw.binding import Mode, bind, model_signature, stateful_modules
from megatron_longstraw.longstraw.context_parallel import capture_prompt_cp, context_parallel_group
from megatron_longstraw.longstraw.expert_lockstep import ExpertLockstep
from megatron_longstraw.longstraw.model_steps import FinalNormInput, decode, output_logits
from megatron_longstraw.longstraw.pipeline import check_pipeline, run_stages
from megatron_longstraw.longstraw.state import PromptState
from megatron_longstraw.models.fp8 import prepare_forward
from megatron_longstraw.models.pipeline_stage import last_chunk


@torch.no_grad()
def capture_prompt(model, prompt_ids_BS: torch.Tensor, chunk_size: int,
                   progress: Optional[Callable[[int], object]] = None) -> PromptState:
    """Run ``prompt_ids_BS`` through ``model`` without autograd, ``chunk_size`` tokens at a time.

    Each chunk attends to the state captured so far plus itself causally; recurrent layers carry
    their state from chunk to chunk. Peak memory is the state plus one chunk's activations.
    Returns the prompt state with the last position's hidden state and next-token logits.
    ``progress``, if given, is called with the number of tokens of each finished chunk.
    Under context parallelism every CP rank calls it with the whole prompt and keeps its shard
    of the state (``context_parallel.capture_prompt_cp``). Under pipeline parallelism every stage
    does, and keeps the state of its own layers: the first stage embeds each chunk, every stage
    runs its layers and hands the chunk's hidden states on (``pipeline.run_stages``; only chunk
    activations cross stages), and only the last stage's state holds the last position's hidden
    state and logits. Under expert parallelism across data-parallel ranks the ranks' chunk counts
    may differ; ``expert_lockstep.ExpertLockstep`` keeps their MoE all-to-alls matched.
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
    if context_parallel_group() is not None:
        return capture_prompt_cp(model, prompt_ids_BS, chunk_size, progress)
    check_pipeline(model)
    last = parallel_state.is_pipeline_last_stage()
    state = PromptState(prompt_length=length, batch=batch, model_signature=model_signature(model))
    for name, module in stateful_modules(model).items():
        state.layers[name] = module.new_prompt_state(length, batch, prompt_ids_BS.device)
    final_norm = FinalNormInput(last_chunk(model)) if last else None
    lockstep = ExpertLockstep(model)  # EP over data-parallel ranks: their prompts differ in length
    try:
        for start in range(0, length, chunk_size):
            chunk_ids_BS = prompt_ids_BS[:, start:start + chunk_size]
            lockstep.busy()
            with bind(model, Mode.CAPTURE, state, position_offset=start, valid_length=chunk_ids_BS.shape[1]):
                hidden_SBH = run_stages(model, chunk_ids_BS, start, lambda part, h: decode(part, h, start))
            if progress is not None:
                progress(chunk_ids_BS.shape[1])
        lockstep.finish()
    finally:
        if final_norm is not None:
            final_norm.remove()
    if last:  # the final norm's input at the last prompt token, and the next-token logits
        state.last_hidden_1BH = final_norm.last_row_1BH(hidden_SBH.shape[0])
        state.last_logits_BV = output_logits(last_chunk(model), hidden_SBH[-1:])[0]
    return state
