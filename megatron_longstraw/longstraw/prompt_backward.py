"""The reverse sweep over the prompt of ``--prompt-gradient exact`` (``core/state_grad.py``).

After a group's replays have accumulated the gradients of the prompt state, ``prompt_backward``
walks the capture chunks last first. For each chunk it recomputes the forward with autograd
(``SweepBinding``) from the state of the positions before it, which enters read-only with its
gradients going into the state's buffers, and backpropagates, in one backward, the accumulated
gradients of the chunk's own state entries (its K/V pages, a recurrent layer's state after the
chunk, for the last chunk the final norm's input at the last position). Parameter gradients add
to those of replay; a recurrent layer's gradient at the chunk's start becomes that of the
previous chunk's final state. Every gradient of a chunk's entries is complete when the chunk is
recomputed: later positions depend on it only through the state, whose consumers (the later
chunks and the responses) have all been backpropagated by then.

Memory: the state, its gradient buffers, the recurrent layers' chunk-start states (kept by an
``exact`` capture) and one chunk's activations; nothing per response.

Pipeline parallelism: the same sweep stage to stage through Megatron's schedule, one call per
chunk (``pipeline.prompt_backward_pp``); each stage injects its own layers' entries. With CP too,
each stage recomputes its CP shard of the chunk in that call, and the CP bookkeeping below runs
per stage over its CP group.

Tensor parallelism: each rank's state and buffers hold its own heads (a replicated state, as
MLA's latents, gets each rank's partial gradient, summed by the recompute's own backward, as in
full backprop); under sequence parallelism the chunk's padding rows keep no state and get none of
the injected gradients. Expert parallelism over data-parallel ranks: the ranks' chunk counts
differ, so each chunk is one round of ``expert_lockstep.ExpertLockstep`` (with backward).

Context parallelism: each rank recomputes its own shard of every chunk, the chunk's queries
travelling as in capture, through collectives whose backward communicates too
(``cp_attention.cp_sweep_attention``, ``cp_sparse_attention.cp_sweep_sparse_latent_attention``,
Gated DeltaNet's fold through ``collectives.all_gather_rows_with_grad``): each rank's pages get
their complete gradient there. A value replicated over the ranks (a recurrent layer's state and
conv tail at a chunk's start or end) gets its gradient once: injected on the last rank, and at the
chunk's start summed over the ranks. Every rank backpropagates every layer of every chunk (a zero
gradient at the final norm's input but on the last rank in the last chunk), so the backward
collectives pair up. Replay leaves the same gradients on every CP rank; the sweep's shares
differ by rank, so the replicated ones stay on the first CP rank only and the sum over CP at the
end gives every rank the full gradient, as after a detached replay (``core/collectives.py``);
``prompt_backward`` does both around the sweep, with or without PP.

Served so far: TP (with or without sequence parallelism), CP, EP (not with TP, CP or PP), PP
(with virtual stages, with TP + sequence parallelism, with CP), and stateful layers with
``supports_prompt_gradient``: full attention and Gated DeltaNet (the Qwen3.5 family), absorbed
MLA with DSA (GLM-5: the MLA latents carry gradient; the DSA indexer's keys do not, its top-k is
recomputed without grad as in capture). A MoE layer is recomputed like
any other; ``models/glm5/`` (its package doc) says what the recompute adds to the router's expert-bias token
counts. ``check_prompt_gradient_support`` names, with the flag, what is not served.
"""

import contextlib
from typing import Callable, ContextManager, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_longstraw.core.binding import SweepBinding, bind, stateful_modules
from megatron_longstraw.core.collectives import context_parallel_group, sweep_chunks
from megatron_longstraw.core.state import PromptState
from megatron_longstraw.core.state_grad import SweepTargets
from megatron_longstraw.longstraw.expert_lockstep import ExpertLockstep
from megatron_longstraw.longstraw.model_steps import FinalNormInput, decode, embed, without_activation_recompute
from megatron_longstraw.longstraw.pipeline import pipeline_parallel, prompt_backward_pp


def check_prompt_gradient_support(model) -> None:
    """``ValueError`` naming ``--prompt-gradient exact`` and the first thing it cannot serve yet."""
    flag = "--prompt-gradient exact"
    cp, pp = parallel_state.get_context_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    if ep > 1 and max(parallel_state.get_tensor_model_parallel_world_size(), cp, pp) > 1:
        raise ValueError(f"{flag} is not supported with --expert-model-parallel-size {ep} > 1 together with "
                         "tensor, context or pipeline parallelism yet")
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
    cp_group = context_parallel_group()  # under PP: this stage's CP group
    if cp_group is not None:
        _count_replicated_gradients_once(model, cp_group)
    with without_activation_recompute(model):  # (see there: injected gradients need the chunk's graph)
        if pipeline_parallel():  # one schedule call per chunk, stage to stage
            prompt_backward_pp(model, state, prompt_ids_BS, chunk_context)
        else:
            _sweep(model, state, prompt_ids_BS, chunk_context)
    if cp_group is not None:
        _sum_gradients(model, cp_group)


def _sweep(model, state: PromptState, prompt_ids_BS: torch.Tensor,
           chunk_context: Optional[Callable[[int], ContextManager]]) -> None:
    """The chunk loop of ``prompt_backward`` on this rank (its CP shard of every chunk)."""
    cp_group = context_parallel_group()
    chunks = sweep_chunks(state, cp_group)
    lockstep = ExpertLockstep(model, backward=True)  # EP over data-parallel ranks: chunk counts differ
    for index in reversed(range(len(chunks))):
        start, end, shard_sizes, local_offset = chunks[index]
        targets = SweepTargets()
        # under CP the last position is on the last rank
        last = index == len(chunks) - 1 and (cp_group is None or dist.get_rank(cp_group) == cp_group.size() - 1)
        # under the lockstep every chunk's backward reaches the last layer (a zero gradient at its
        # output but in the last chunk), so each round backpropagates every MoE layer; under CP
        # so that every rank runs every layer's backward collectives
        reach_all = lockstep.active or cp_group is not None
        final_norm = FinalNormInput(model, keep_graph=True) if last or reach_all else None
        lockstep.busy()
        try:
            around = chunk_context(index) if chunk_context is not None else contextlib.nullcontext()
            binding = SweepBinding(position_offset=start, valid_length=end - start, targets=targets,
                                   shard_sizes=shard_sizes, local_offset=local_offset)
            with around, torch.enable_grad(), bind(model, binding, state):
                decode(model, embed(model, prompt_ids_BS[:, start:end], start), start)
                if final_norm is not None:  # the final norm's input at the last position (every response reads it)
                    targets.inject_reaching(final_norm.last_row_1BH(end - start),
                                            state.last_hidden_grad_1BH if last else None)
                targets.backward()
        finally:
            if final_norm is not None:
                final_norm.remove()
    lockstep.finish()


def _gradient(param) -> Optional[torch.Tensor]:
    """Where ``param``'s gradient accumulates: Megatron DDP's ``main_grad`` when wrapped, else ``grad``."""
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


def _count_replicated_gradients_once(model, cp_group) -> None:
    """Before a sweep under CP every CP rank holds the same gradients (replay's, replicated:
    ``core/collectives.py``); they stay on the group's first rank only, so that the sum of the
    ranks' gradients after the sweep (``_sum_gradients``) counts them once."""
    if dist.get_rank(cp_group) == 0:
        return
    for param in model.parameters():
        grad = _gradient(param)
        if grad is not None:
            grad.zero_()


def _sum_gradients(model, cp_group) -> None:
    """Every parameter's gradient summed over the CP group: each rank's sweep adds the gradient of
    its own shards only. A parameter without a gradient on some ranks gets zeros there first."""
    params = [p for p in model.parameters() if p.requires_grad]
    device = next(iter(params)).device
    present = torch.tensor([_gradient(p) is not None for p in params], dtype=torch.int32, device=device)
    dist.all_reduce(present, op=dist.ReduceOp.MAX, group=cp_group)
    for param, any_rank in zip(params, present.tolist()):
        if not any_rank:
            continue
        if _gradient(param) is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(_gradient(param), group=cp_group)
