"""The reverse sweep over the prompt of ``--prompt-gradient exact`` (``core/state_grad.py``).

After a group's replays have accumulated the gradients of the prompt state, ``prompt_backward``
walks the capture chunks last first. For each chunk it recomputes the forward with autograd
(``Mode.SWEEP``) from the state of the positions before it, which enters read-only with its
gradients going into the state's buffers, and backpropagates, in one backward, the accumulated
gradients of the chunk's own state entries (its K/V pages, a recurrent layer's state after the
chunk, for the last chunk the final norm's input at the last position). Parameter gradients add
to those of replay; a recurrent layer's gradient at the chunk's start becomes that of the
previous chunk's final state. Every gradient of a chunk's entries is complete when the chunk is
recomputed: later positions depend on it only through the state, whose consumers (the later
chunks and the responses) have all been backpropagated by then.

Memory: the state, its gradient buffers, the recurrent layers' chunk-start states (kept by an
``exact`` capture) and one chunk's activations; nothing per response.

Served so far: one rank of each model-parallel kind (no TP, CP or PP, no sequence parallelism)
and stateful layers with ``supports_prompt_gradient``: full attention and Gated DeltaNet (the
Qwen3.5 family), absorbed MLA with DSA (GLM-5: the MLA latents carry gradient; the DSA indexer's
keys do not, its top-k is recomputed without grad as in capture). A MoE layer is recomputed like
any other; ``models/glm5.py`` says what the recompute adds to the router's expert-bias token
counts. ``check_prompt_gradient_support`` names, with the flag, what is not served.
"""

import contextlib
from typing import Callable, ContextManager, Optional

import torch
from megatron.core import parallel_state

from megatron_longstraw.core.binding import Mode, bind, stateful_modules
from megatron_longstraw.core.state import PromptState
from megatron_longstraw.core.state_grad import SweepTargets
from megatron_longstraw.longstraw.model_steps import FinalNormInput, decode, embed, sequence_parallel


def check_prompt_gradient_support(model) -> None:
    """``ValueError`` naming ``--prompt-gradient exact`` and the first thing it cannot serve yet."""
    flag = "--prompt-gradient exact"
    for name, size in (("tensor-model", parallel_state.get_tensor_model_parallel_world_size()),
                       ("context", parallel_state.get_context_parallel_world_size()),
                       ("pipeline-model", parallel_state.get_pipeline_model_parallel_world_size())):
        if size > 1:
            raise ValueError(f"{flag} is not supported with --{name}-parallel-size {size} > 1 yet")
    if sequence_parallel(model):
        raise ValueError(f"{flag} is not supported with --sequence-parallel yet")
    for name, module in stateful_modules(model).items():
        if not getattr(module, "supports_prompt_gradient", False):
            raise ValueError(f"{flag}: layer kind {type(module).__name__} ({name}) cannot backpropagate "
                             "through its prompt state yet; served: full attention (SDPACoreAttention), "
                             "Gated DeltaNet (the Qwen3.5 family), absorbed MLA with DSA (GLM-5)")


def prompt_backward(model, state: PromptState, prompt_ids_BS: torch.Tensor,
                    chunk_context: Optional[Callable[[int], ContextManager]] = None) -> None:
    """The reverse sweep (module doc) over ``prompt_ids_BS``, the prompt ``state`` was captured
    from with ``exact=True`` and replayed against with ``exact=True``; parameter gradients
    accumulate in ``model``. The state's gradient buffers are consumed (left as after the sweep).
    ``chunk_context(index)``, if given, wraps chunk ``index``'s recompute and backward (the
    benchmark meters one chunk's saved activations with it)."""
    check_prompt_gradient_support(model)
    if prompt_ids_BS.shape[1] != state.prompt_length or not state.chunk_starts:
        raise ValueError(f"prompt of {prompt_ids_BS.shape[1]} tokens for a prompt state of "
                         f"{state.prompt_length} tokens")
    ends = state.chunk_starts[1:] + (state.prompt_length,)
    chunks = list(zip(state.chunk_starts, ends))
    for index in reversed(range(len(chunks))):
        start, end = chunks[index]
        targets = SweepTargets()
        last = index == len(chunks) - 1
        final_norm = FinalNormInput(model, keep_graph=True) if last else None
        try:
            # backward inside the binding: recomputed layers re-run forward in the same mode
            around = chunk_context(index) if chunk_context is not None else contextlib.nullcontext()
            with around, torch.enable_grad(), bind(model, Mode.SWEEP, state, position_offset=start,
                                                   valid_length=end - start, sweep=targets):
                decode(model, embed(model, prompt_ids_BS[:, start:end], start), start)
                if last:  # the final norm's input at the last position, read by every response
                    targets.inject(final_norm.input_SBH[-1:], state.last_hidden_grad_1BH)
                targets.backward()
        finally:
            if final_norm is not None:
                final_norm.remove()
