"""Megatron's Gated DeltaNet with LongStraw prompt state (recurrent state and conv tail).

``LongStrawGatedDeltaNet`` is Megatron's ``GatedDeltaNet``; unbound, it runs Megatron's own
forward (context parallelism, packed sequences). Bound by ``core/binding.py``'s ``bind``, one
method per mode runs the same steps (``_mixer``) with the kernels' state inputs/outputs in use:
capture carries the fp32 recurrent state and the conv tail from chunk to chunk; replay starts
every response from the detached prompt state; decode carries each sample's own copy of the
state (``new_decode_state``) from token to token; the reference mode detaches the prompt rows of
everything that forms that state.

Under context parallelism (``core/collectives.py``) the bound forward keeps every head
on every CP rank (Megatron's own CP splits heads by all-to-all; LongStraw shards the sequence):
capture hands the recurrent state and the conv tail across the chunk's CP shards exactly
(``_capture_cp_*``), so the state after the prompt is replicated on every CP rank and replay
runs unchanged (each rank replays the whole, replicated, response). The reverse sweep of
``--prompt-gradient exact`` recomputes a shard with the same hand-over, gathered with autograd
(``collectives.all_gather_rows_with_grad``): the chunk's start state enters every rank through an
all-reduce backward (its gradient sums every rank's share), and its final state, replicated, gets
its accumulated gradient on the last rank only.
"""

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
from megatron.core.ssm.gated_delta_net import GatedDeltaNet
from megatron.core.ssm.gated_delta_net import gdn as mcore_gdn
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

from megatron_longstraw.core.binding import (
    CaptureBinding, DecodeBinding, ReferenceBinding, ReplayBinding, StatefulModule, SweepBinding, detach_prefix,
    read_state)
from megatron_longstraw.core.collectives import all_gather_rows, all_gather_rows_with_grad, context_parallel_group
from megatron_longstraw.core.state import LayerState
from megatron_longstraw.core.state_grad import read_with_grad


@dataclass
class GatedDeltaState(LayerState):
    """fp32 recurrent state ``[b, heads_v, d_k, d_v]`` after the last prompt token and the conv
    tail, the last ``kernel - 1`` conv inputs ``[b, channels, kernel - 1]`` (this rank's heads)."""

    recurrent_BHKV: torch.Tensor
    conv_tail_BCW: torch.Tensor
    chunk_starts: dict = field(default_factory=dict)
    """``--prompt-gradient exact``: ``{chunk start: (recurrent state, conv tail)}`` before every
    capture chunk, the starting points of the reverse sweep's recomputation"""

    def nbytes(self) -> int:
        """Bytes of the state, the kept chunk-start states included."""
        kept = sum(t.numel() * t.element_size() for pair in self.chunk_starts.values() for t in pair)
        return super().nbytes() + kept

    def free(self) -> None:
        """Drop the tensors, the chunk-start states and the gradient buffers."""
        super().free()
        self.chunk_starts.clear()


@functools.cache  # per kernel function: resolved once, not at every layer of every decode step
def _decode_kernel(chunk_kernel):
    """The delta-rule kernel of a decode step: fla's fused recurrent kernel (a step's one or few
    tokens in one launch, where the chunked one launches a dozen; the same recurrence) where the
    layer runs fla's chunked kernel, else the layer's own (Megatron's deterministic torch kernel,
    or the pure-torch one of ``patches/cpu_gated_delta_kernels``)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return chunk_kernel
    return fused_recurrent_gated_delta_rule if chunk_kernel is chunk_gated_delta_rule else chunk_kernel


def _batch_to(state: torch.Tensor, batch: int) -> torch.Tensor:
    """A prompt state of batch 1 shared by ``batch`` responses (copied: the kernels want it dense)."""
    return state if state.shape[0] == batch else state.expand(batch, *state.shape[1:]).contiguous()


def _capture_cp_conv(tail_BCW: torch.Tensor, qkv_BSC: torch.Tensor, shard_sizes, group, gather=all_gather_rows):
    """Conv tails across a chunk's CP shards: ``(this shard's initial tail, the chunk's final
    tail)``, both ``[b, channels, kernel - 1]``, from the tail before the chunk and every shard's
    last ``kernel - 1`` conv inputs (all-gathered by ``gather``, with autograd in the reverse
    sweep; shards shorter than that pass on part of it)."""
    width = tail_BCW.shape[-1]
    rank = dist.get_rank(group)
    lasts = gather(qkv_BSC[:, -width:], tuple(min(n, width) for n in shard_sizes), group, dim=1)
    own = None
    for r, last_BSC in enumerate(lasts):
        if r == rank:
            own = tail_BCW
        tail_BCW = torch.cat([tail_BCW, last_BSC.transpose(1, 2).to(tail_BCW.dtype)], dim=-1)[..., -width:]
    return own, tail_BCW


def _capture_cp_recurrent(start_BHKV: torch.Tensor, transition_BHKX: torch.Tensor, value_dim: int, group,
                          gather=all_gather_rows):
    """Recurrent states across a chunk's CP shards: ``(this shard's start state, the chunk's
    final state)`` from the state before the chunk and every shard's transition
    ``[B | A]`` (``S_end = A S_start + B``), all-gathered by ``gather`` (with autograd in the
    reverse sweep) and folded in rank order (so every rank computes the same final state, bit
    for bit)."""
    rank = dist.get_rank(group)
    parts = gather(transition_BHKX, (transition_BHKX.shape[0],) * dist.get_world_size(group), group)
    compute = torch.promote_types(transition_BHKX.dtype, torch.float32)
    state = start_BHKV.to(compute)
    own = None
    for r, part in enumerate(parts):
        if r == rank:
            own = state
        b_BHKV, a_BHKK = part.to(compute).split([value_dim, part.shape[-1] - value_dim], dim=-1)
        state = a_BHKK @ state + b_BHKV
    return own, state


class _Shards(NamedTuple):
    """A chunk's CP shards for ``_mixer``: the CP group, every rank's token count, and the
    all-gather that hands the state across them (with autograd in the reverse sweep)."""

    group: object
    sizes: tuple[int, ...]
    gather: Callable


class LongStrawGatedDeltaNet(StatefulModule, GatedDeltaNet):
    """Megatron ``GatedDeltaNet`` that can start from / hand on a prompt state."""

    supports_context_parallel = True
    supports_prompt_gradient = True
    supports_static_decode = True  # its decode step updates its state in place, in fixed shapes

    @contextlib.contextmanager
    def _whole_heads(self):
        """Megatron's input preparation with every (TP-local) head: LongStraw's CP shards tokens."""
        cp_size, self.cp_size = self.cp_size, 1
        try:
            yield
        finally:
            self.cp_size = cp_size

    def new_prompt_state(self, prompt_length: int, batch: int, device) -> GatedDeltaState:
        """Zero state (the state before any token)."""
        return GatedDeltaState(  # fp32, or the parameters' dtype if wider (fp64 tests)
            torch.zeros(batch, self.num_v_heads_local_tp, self.key_head_dim, self.value_head_dim,
                        dtype=torch.promote_types(self.config.params_dtype, torch.float32), device=device),
            torch.zeros(batch, self.conv_dim_local_tp, self.conv_kernel_dim - 1,
                        dtype=self.config.params_dtype, device=device),
        )

    def new_decode_state(self, prompt: GatedDeltaState, num_samples: int, capacity: int) -> GatedDeltaState:
        """Each sample's own copy of the prompt's recurrent state and conv tail (it mutates them)."""
        return GatedDeltaState(
            prompt.recurrent_BHKV.expand(num_samples, *prompt.recurrent_BHKV.shape[1:]).clone(),
            prompt.conv_tail_BCW.expand(num_samples, *prompt.conv_tail_BCW.shape[1:]).clone(),
        )

    def forward_bound(self, binding, hidden_states, attention_mask, inference_context=None,
                      packed_seq_params=None, sequence_len_offset=None, *, inference_params=None, **kwargs):
        """The mode's method on ``hidden_states`` (see module doc)."""
        if packed_seq_params is not None:
            raise ValueError("LongStraw Gated DeltaNet: packed sequences are not supported in "
                             "capture/replay")
        return super().forward_bound(binding, hidden_states)

    def forward_capture(self, binding: CaptureBinding, hidden_states):
        """The chunk from the state so far, whose final state then replaces it; with ``exact``
        the state before the chunk is kept as the reverse sweep's start. Under CP the state is
        handed across the chunk's shards (``_capture_cp_*``)."""
        state = binding.state
        shards = _shards(binding, all_gather_rows)
        if binding.exact:
            state.chunk_starts[binding.position_offset] = (state.recurrent_BHKV.clone(), state.conv_tail_BCW.clone())
        out, (recurrent, tail) = self._mixer(hidden_states, (state.recurrent_BHKV, state.conv_tail_BCW),
                                             valid_length=binding.valid_length, shards=shards, final_state=True)
        state.recurrent_BHKV.copy_(recurrent)
        state.conv_tail_BCW.copy_(tail)
        return out

    def forward_replay(self, binding: ReplayBinding, hidden_states):
        """The responses from the prompt state (read with gradients in exact replay); under CP the
        state is replicated, and every rank replays the whole response."""
        start = read_state(binding, "recurrent_BHKV"), read_state(binding, "conv_tail_BCW")
        return self._mixer(hidden_states, start)[0]

    def forward_decode(self, binding: DecodeBinding, hidden_states):
        """The samples' next tokens from their own state, updated in place (fixed shapes)."""
        state = binding.state
        out, (recurrent, tail) = self._mixer(hidden_states, (state.recurrent_BHKV, state.conv_tail_BCW),
                                             valid_length=binding.valid_length, final_state=True, decode=True)
        state.recurrent_BHKV.copy_(recurrent)
        state.conv_tail_BCW.copy_(tail)
        return out

    def forward_sweep(self, binding: SweepBinding, hidden_states):
        """The reverse sweep's recomputed chunk from its kept start state (``_sweep_start``); the
        chunk's final state receives its accumulated gradient. Under CP the shard's hand-over is
        gathered with autograd; the start state, read on every rank, gets the sum of every rank's
        gradient, and the final state, replicated, its gradient on the last rank only."""
        state, group = binding.state, context_parallel_group()
        shards = _shards(binding, all_gather_rows_with_grad)
        start = self._sweep_start(binding)
        if group is not None:  # one start state, read on every rank: its gradient sums every rank's
            start = tuple(copy_to_tensor_model_parallel_region(t, group=group) for t in start)
        out, (recurrent, tail) = self._mixer(hidden_states, start, valid_length=binding.valid_length,
                                             shards=shards, final_state=True)
        grad_recurrent, grad_tail = state.grads.buffer("recurrent_BHKV"), state.grads.buffer("conv_tail_BCW")
        if group is not None and dist.get_rank(group) < dist.get_world_size(group) - 1:
            # the final state is one value replicated on every rank: its gradient enters once,
            # on the last rank; zeros elsewhere, so that every rank runs the fold's backward
            grad_recurrent, grad_tail = torch.zeros_like(grad_recurrent), torch.zeros_like(grad_tail)
        binding.targets.inject(recurrent, grad_recurrent)
        binding.targets.inject(tail, grad_tail)
        return out

    def forward_reference(self, binding: ReferenceBinding, hidden_states):
        """The whole sequence from the zero state, the prompt rows of what forms the state
        detached; not under CP."""
        group = context_parallel_group()
        if group is not None:
            raise ValueError(f"LongStraw Gated DeltaNet: the full-graph baseline (--replay-mode full) "
                             f"is not supported with --context-parallel-size {group.size()} > 1")
        return self._mixer(hidden_states, prefix_length=binding.prefix_length)[0]

    def _mixer(self, hidden_states, start=None, *, valid_length: Optional[int] = None, prefix_length: int = 0,
               shards: Optional[_Shards] = None, final_state: bool = False, decode: bool = False):
        """Megatron's Gated DeltaNet on ``hidden_states`` ``[s, b, h]``, every mode's steps:
        ``(output [s, b, h], (final recurrent state, final conv tail) or None)``.

        ``start``: ``(recurrent state, conv tail)`` to start from (``None``: zeros);
        ``valid_length``: the real tokens, the state runs over them (sequence parallelism pads
        the tokens at the end; the padding rows' output is zeros); ``prefix_length``: rows
        whose state-forming tensors are detached; ``shards``: this input is a CP shard of a
        chunk, the state handed across the shards (``_capture_cp_*``); ``final_state``: compute
        the final state; ``decode``: the decode step's kernel (``_decode_kernel``).
        """
        qkvzba_BSX = self.in_proj(hidden_states)[0].transpose(0, 1)
        padded_len = qkvzba_BSX.shape[1]
        if valid_length is not None:
            qkvzba_BSX = qkvzba_BSX[:, :valid_length]
        batch, seq_len = qkvzba_BSX.shape[:2]
        # Megatron's feat_dim_split divides by the CP size (its CP splits heads); every head is local here
        heads_v = self.num_value_heads // self.tp_size
        split = (self.qk_dim_local_tp * 2 + self.v_dim_local_tp, self.v_dim_local_tp, heads_v, heads_v)
        qkv, gate, beta, alpha = torch.split(qkvzba_BSX, split, dim=-1)
        gate = gate.reshape(batch, seq_len, -1, self.value_head_dim)

        conv_state = chunk_tail = None
        if start is not None:  # fla's conv state is [b, channels, kernel]
            start_recurrent, start_tail = start
            tail = _batch_to(start_tail, batch)
            if shards is not None:
                tail, chunk_tail = _capture_cp_conv(tail, qkv, shards.sizes, shards.group, shards.gather)
            conv_state = torch.cat([tail.new_zeros(batch, tail.shape[1], 1), tail], dim=-1)
        qkv, conv_final = mcore_gdn.causal_conv1d(
            x=detach_prefix(qkv, prefix_length, 1), weight=self.conv1d.weight.squeeze(1),
            bias=self.conv1d.bias if self.conv_bias else None, activation=self.activation,
            initial_state=conv_state, output_final_state=final_state,
        )
        with self._whole_heads():
            query, key, value, gate, beta, alpha = self._prepare_input_for_gated_delta_rule(
                qkv, gate, batch, seq_len, beta, alpha)
        g, beta = self._compute_g_and_beta(self.A_log, self.dt_bias, alpha, beta)
        key, value, g, beta = (detach_prefix(t, prefix_length, 1) for t in (key, value, g, beta))

        if shards is not None:
            core_out, recurrent_final = self._capture_cp_delta_rule(query, key, value, g, beta, start_recurrent,
                                                                    shards.group, shards.gather)
        else:
            recurrent = _batch_to(start_recurrent, batch) if start is not None else None
            kernel = _decode_kernel(self.gated_delta_rule) if decode else self.gated_delta_rule
            core_out, recurrent_final = kernel(
                query, key, value, g=g, beta=beta, initial_state=recurrent,
                output_final_state=final_state, use_qk_l2norm_in_kernel=False,
            )
        final = None
        if final_state:
            final = recurrent_final, conv_final[:, :, 1:] if chunk_tail is None else chunk_tail

        # Megatron's _gated_norm_and_a2a without its CP all-to-all (every head is local here)
        norm_out = self._apply_gated_norm(core_out, gate).reshape(batch, seq_len, -1)
        if padded_len > seq_len:  # the padding rows' output: zeros
            norm_out = torch.cat([norm_out, norm_out.new_zeros(batch, padded_len - seq_len, norm_out.shape[-1])], 1)
        return self.out_proj(norm_out.transpose(0, 1).contiguous()), final

    def _compute_g_and_beta(self, A_log_local_cp, dt_bias_local_cp, alpha, beta):
        """Megatron's decay and beta; in fp64 for an fp64 model, where Megatron computes the decay in
        fp32 (below fp64 Megatron's own fused function runs)."""
        if alpha.dtype != torch.float64:
            return super()._compute_g_and_beta(A_log_local_cp, dt_bias_local_cp, alpha, beta)
        return -A_log_local_cp.exp() * torch.nn.functional.softplus(alpha + dt_bias_local_cp), beta.sigmoid()

    def _apply_gated_norm(self, x, gate):
        """Megatron's output norm and gate; in fp64 for an fp64 model, where Megatron gates in
        fp32 (below fp64 Megatron's own fused function runs)."""
        if x.dtype != torch.float64:
            return super()._apply_gated_norm(x, gate)
        y = self.out_norm(x.reshape(-1, x.shape[-1]))
        return y * self.act_fn(gate.reshape(-1, gate.shape[-1]))

    def _sweep_start(self, binding: SweepBinding):
        """``(recurrent state, conv tail)`` the swept chunk starts from: its start kept by the
        exact capture, read with gradients into fresh buffers, which become the gradients of the
        previous chunk's final state once the chunk's backward is done."""
        state = binding.state
        recurrent, tail = state.chunk_starts[binding.position_offset]
        grad_recurrent = torch.zeros_like(state.grads.buffer("recurrent_BHKV"))
        grad_tail = torch.zeros_like(state.grads.buffer("conv_tail_BCW"))

        def hand_on():
            state.grads.replace("recurrent_BHKV", grad_recurrent)
            state.grads.replace("conv_tail_BCW", grad_tail)
        binding.targets.then(hand_on)
        return read_with_grad(recurrent, grad_recurrent), read_with_grad(tail, grad_tail)

    def _capture_cp_delta_rule(self, query, key, value, g, beta, start_BHKV, cp_group, gather=all_gather_rows):
        """The delta rule on this rank's shard of a chunk from the chunk's start state
        ``start_BHKV``, exact across the CP shards (see the module doc of
        ``core/collectives.py``): a first kernel call from ``[0 | I]`` with values ``[v | 0]``
        gives the shard's transition ``[B | A]``; the fold (``gather``: with autograd in the
        reverse sweep) gives this shard's start state, from which a second, ordinary call
        computes the output (so the output is the kernel's own, not a zero-start output plus a
        bf16-rounded correction)."""
        batch, _, heads, dim_k = key.shape
        dim_v = value.shape[-1]
        eye = torch.eye(dim_k, dtype=torch.float32, device=key.device)
        start_BHKX = torch.cat([key.new_zeros(batch, heads, dim_k, dim_v, dtype=torch.float32),
                                eye.expand(batch, heads, dim_k, dim_k)], dim=-1).contiguous()
        value_aug = torch.cat([value, value.new_zeros(*value.shape[:-1], dim_k)], dim=-1)
        _, transition = self.gated_delta_rule(
            query, key, value_aug, g=g, beta=beta, initial_state=start_BHKX,
            output_final_state=True, use_qk_l2norm_in_kernel=False,
        )
        own_start, final = _capture_cp_recurrent(start_BHKV, transition, dim_v, cp_group, gather)
        core_out, _ = self.gated_delta_rule(
            query, key, value, g=g, beta=beta, initial_state=own_start.to(start_BHKV.dtype).contiguous(),
            output_final_state=False, use_qk_l2norm_in_kernel=False,
        )
        return core_out, final


def _shards(binding, gather: Callable) -> Optional[_Shards]:
    """The CP shards of a capture or sweep binding's chunk (``None`` without CP)."""
    group = context_parallel_group()
    if group is None:
        return None
    if binding.shard_sizes is None:
        raise ValueError("LongStraw Gated DeltaNet: capture under context parallelism needs the "
                         "chunk's shard sizes (use capture_prompt)")
    return _Shards(group, binding.shard_sizes, gather)
