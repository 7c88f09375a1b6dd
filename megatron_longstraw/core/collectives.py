"""Context parallelism (CP) for LongStraw: the prompt state sharded over the CP group, and the
low-level collectives every CP path uses (``context_parallel_group``, ``shard_plan``,
``all_gather_rows``, ``broadcast_from_last``; the reverse sweep's ``sweep_chunks``). The capture
loop itself is ``longstraw/capture.py``; with CP=1 it runs the trivial shard plan of this layout.

Layout ("pages stay, queries travel"). The prompt is cut into global chunks of
``--prompt-chunk-size`` tokens (a last chunk shorter than the CP size is folded into the one
before it), and every chunk into ``cp`` contiguous shards of near-equal size (the first
``n % cp`` shards one token longer), shard ``r`` going to CP rank ``r``. All ranks capture their
shard of a chunk at the same time; a rank keeps the full-attention K/V pages of its shards only,
so the pages per rank are ``~prompt / cp`` rows. With one chunk (chunk size >= prompt) the
shards are plain contiguous shards of the prompt; with smaller chunks each rank's pages are its
shard of every chunk (the order of pages does not matter: the whole prompt is visible to every
later token). Contiguous shards of each chunk, rather than Megatron's load-balanced
2 x cp halves, keep the per-chunk capture simple and make Gated DeltaNet's cross-shard state
exact with one sequential fold (below); the attention work of a chunk is balanced anyway,
because each rank attends *every* query of the chunk over its own pages.

Per layer kind:

- Full attention (``attention/cp_attention.py``). Capture: the chunk's queries are all-gathered
  (chunk-sized), each rank computes the partial output and log-sum-exp of all of them over its
  own pages plus its own shard of the chunk's keys (causally), and one all-reduce merges the
  partials exactly (global max and sum of exponentials). No rank ever holds another rank's
  pages. Replay: the response is replicated on every CP rank; each rank attends the response
  queries over its own pages, the partials merge the same way, and the response's causal part
  over itself is computed on every rank. Backward all-reduces the queries' gradient from the
  prompt parts, so every CP rank ends with exactly the CP=1 gradient (see below). Decode
  (``attention/decode_attention.py``): every CP rank decodes the same G samples; a new token's
  query attends over this rank's pages, the partials merge with ``merge_partials_over_group``
  (``attention/partials.py``), and the samples' own
  generated keys (replicated, per sample, on every rank) are merged in locally after that global
  merge, so they count once. The prompt pages stay shared by the samples, never copied.
- Gated DeltaNet (``models/gated_delta_net.py``). The delta rule is linear in the state:
  over a shard, ``S_end = A S_start + B`` with ``A`` ``[d_k, d_k]`` per head. One kernel call from
  the state ``[0 | I]`` with values ``[v | 0]`` yields ``[B | A]`` as its final state. Ranks
  all-gather ``(A, B)`` and fold them in rank order (fp32) from the chunk's start state: every
  rank gets its shard's start state and the same final state, which is therefore replicated on
  every CP rank (it is small: ``heads x d_k x d_v``). A second, ordinary kernel call from the
  shard's start state then gives the shard's output (the Gated DeltaNet kernels cost little next
  to attention, and the output is the kernel's own rather than a correction rounded to bf16).
  The conv tail is handed on the same way (all-gather of each shard's last ``kernel - 1`` inputs). Decode is
  unchanged: each sample's copy of the replicated state advances identically on every rank.

Rollouts under CP (``rollout/generate.py``): the generated tokens are replicated over the CP
group. Every CP rank samples from the same (merged) logits, and CP rank 0's tokens are then
broadcast over the group, so all ranks feed the same tokens whatever their generators (the
trainer seeds the generator identically on every CP rank anyway: the seed uses the DP rank
without CP).

Gradients under CP. Megatron's DDP averages gradients over the DP x CP group. In replay every
CP rank runs the same (replicated) response and, thanks to the all-reduce of the query gradient
inside the attention merge, holds the *full* CP=1 gradient; the average over CP is then that
gradient. A loss must therefore not be scaled by the CP size (Megatron's pretraining schedule
multiplies its loss by ``cp`` because there each rank sees only a shard of the tokens). With
``--prompt-gradient exact`` the reverse sweep (``longstraw/prompt_backward.py``) recomputes each
rank's own shards through collectives that backpropagate (``all_gather_rows_with_grad``) and sums
the gradients over CP at its end, so every CP rank again holds the full gradient.

- GLM-5's MLA latents and DSA indexer keys (``attention/cp_sparse_attention.py``): each rank
  keeps the latents and indexer keys of its shards with their global positions. The DSA top-k
  is selected globally (local candidates, all-gathered, ranked by score then position, so the
  selection is CP=1's), and the sparse attention over the selected latents merges the ranks'
  partials by log-sum-exp, queries travelling as for full attention. Decode
  (``models/glm5/decode.py``) is full attention's: every CP rank decodes the same G samples, a new
  token's indexer query is scored against this rank's prompt keys and the samples' own
  (replicated) keys, the top-k chosen globally the same way, and its attention over this rank's
  selected latents merges over the group before the own latents' part is merged in once.

With pipeline parallelism, each stage captures its layers for its CP shard of every chunk and
hands the shard's hidden states to the next stage of the same CP rank; replay, scoring and
decoding go through the stages as without CP (``longstraw/pipeline.py``), each stage's attention
merging over its CP group.

Not yet under CP: prompt batches larger than one and the full-graph baseline (``Mode.REFERENCE``);
each raises ``ValueError``.
"""

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_longstraw.core.state import PromptState


def context_parallel_group():
    """Megatron's CP group when its size is > 1, else ``None``."""
    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_context_parallel_world_size() == 1:
        return None
    return parallel_state.get_context_parallel_group()


def shard_plan(prompt_length: int, chunk_size: int, cp: int) -> list[tuple[int, tuple[int, ...]]]:
    """``[(chunk start, shard sizes per CP rank)]`` for a prompt (see the module doc).

    Every shard has at least one token: ``ValueError`` when the prompt or the chunk size is
    shorter than the CP size.
    """
    if prompt_length < cp:
        raise ValueError(f"a prompt of {prompt_length} tokens cannot be split over "
                         f"--context-parallel-size {cp} (every CP rank needs at least one token)")
    if chunk_size < cp:
        raise ValueError(f"--prompt-chunk-size {chunk_size} must be >= --context-parallel-size {cp} "
                         "(every CP rank captures a shard of each chunk)")
    bounds = list(range(0, prompt_length, chunk_size)) + [prompt_length]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] < cp:
        del bounds[-2]  # fold a too-short last chunk into the one before
    plan = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        n = end - start
        plan.append((start, tuple(n // cp + (r < n % cp) for r in range(cp))))
    return plan


def sweep_chunks(state: PromptState, cp_group) -> list[tuple[int, int, Optional[tuple[int, ...]], int]]:
    """``[(first position, end, shard sizes, local offset)]`` of this rank's part of every capture
    chunk of ``state``, for the reverse sweep of ``--prompt-gradient exact``: the chunk itself
    without CP (``cp_group`` ``None``: no shard sizes; the local offset is the position), under
    CP this rank's shard, the chunk's shard sizes (from every rank's shard starts) and the rows of
    this rank's state before the shard. Every rank of ``cp_group`` calls it."""
    if cp_group is None:
        ends = state.chunk_starts[1:] + (state.prompt_length,)
        return [(start, end, None, start) for start, end in zip(state.chunk_starts, ends)]
    cp, rank, count = cp_group.size(), dist.get_rank(cp_group), len(state.chunk_starts)
    starts = torch.tensor(state.chunk_starts, dtype=torch.int64, device=state.device)
    by_rank = [part.tolist() for part in all_gather_rows(starts, (count,) * cp, cp_group)]
    chunks, local = [], 0
    for c in range(count):
        bounds = [by_rank[r][c] for r in range(cp)] + [by_rank[0][c + 1] if c + 1 < count else state.prompt_length]
        sizes = tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        chunks.append((bounds[rank], bounds[rank + 1], sizes, local))
        local += sizes[rank]
    return chunks


def all_gather_rows(x: torch.Tensor, sizes: tuple[int, ...], group, dim: int = 0) -> list[torch.Tensor]:
    """Every rank's ``x`` (``sizes[r]`` rows along ``dim`` on rank ``r``), in rank order; no autograd."""
    longest = max(sizes)
    pad = longest - x.shape[dim]
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.new_zeros(shape)], dim=dim)
    parts = [torch.empty_like(x) for _ in sizes]
    dist.all_gather(parts, x.contiguous(), group=group)
    return [p.narrow(dim, 0, n) for p, n in zip(parts, sizes)]


class _AllGatherRows(torch.autograd.Function):
    """``all_gather_rows`` whose backward hands each rank the sum over the group of the
    gradients of its own rows (an all-reduce of every part's gradient, then this rank's part)."""

    @staticmethod
    def forward(ctx, x, sizes, group, dim):
        ctx.sizes, ctx.group, ctx.dim = sizes, group, dim
        return tuple(all_gather_rows(x, sizes, group, dim))

    @staticmethod
    def backward(ctx, *grads):
        longest = max(ctx.sizes)
        padded = []
        for grad, n in zip(grads, ctx.sizes):
            shape = list(grad.shape)
            shape[ctx.dim] = longest - n
            padded.append(torch.cat([grad, grad.new_zeros(shape)], dim=ctx.dim))
        total = torch.stack(padded).contiguous()
        dist.all_reduce(total, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return total[rank].narrow(ctx.dim, 0, ctx.sizes[rank]), None, None, None


def all_gather_rows_with_grad(x: torch.Tensor, sizes: tuple[int, ...], group, dim: int = 0) -> list[torch.Tensor]:
    """``all_gather_rows`` with autograd, for a computation that differs by rank after the
    gather (the reverse sweep, where each rank keeps its own rows): the gradient of ``x`` is the
    sum of every rank's gradient of its copy. Every rank must backpropagate through it."""
    return list(_AllGatherRows.apply(x, tuple(sizes), group, dim))


def broadcast_from_last(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` of the group's last rank, on every rank (same shape and dtype everywhere)."""
    x = x.contiguous()
    dist.broadcast(x, src=dist.get_global_rank(group, dist.get_world_size(group) - 1), group=group)
    return x
