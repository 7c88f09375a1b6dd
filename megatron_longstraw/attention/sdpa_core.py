"""Causal core attention on torch SDPA, in Megatron's ``core_attention`` interface, with prompt state.

Megatron's local ``DotProductAttention`` materializes the full score matrix and allocates on
``torch.cuda.current_device()``; this core calls torch SDPA instead and is where LongStraw's
K/V pages live: it receives post-RoPE queries, keys and values, so in capture it appends the
chunk's keys/values to the pages and in replay attends over them (``prefix_attention``). In
decode each sample appends its new token's keys/values to its own pages and attends over the
shared prompt pages plus its own (``decode_attention``). Under context parallelism the pages
are sharded over the CP group and capture/replay/decode merge every rank's part (``cp_attention``,
``decode_attention``). The kernels run with the module's ``kernel_options`` (``KernelOptions``:
backend, prefix block), which the model build sets.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_longstraw.attention.cp_attention import (
    cp_capture_attention, cp_prefix_causal_attention, cp_sweep_attention)
from megatron_longstraw.attention.decode_attention import decode_attention
from megatron_longstraw.attention.kernel_options import UsesKernelOptions
from megatron_longstraw.attention.prefix_attention import prefix_causal_attention
from megatron_longstraw.core.binding import Mode, StatefulModule, detach_prefix, pad_rows_to
from megatron_longstraw.core.collectives import context_parallel_group
from megatron_longstraw.core.state import LayerState
from megatron_longstraw.core.state_grad import read_with_grad


@dataclass
class AttentionKVState(LayerState):
    """Full attention: post-RoPE keys and values of the prompt, ``[s, b, groups, d]``.

    Filled page by page during capture (``length`` tokens so far) into buffers sized for the
    whole prompt, so capture never concatenates.
    """

    key_SBGD: torch.Tensor
    value_SBGD: torch.Tensor
    length: int = 0

    sample_dim = 1

    def append(self, key_SBGD: torch.Tensor, value_SBGD: torch.Tensor) -> None:
        """Write the next page of keys/values."""
        end = self.length + key_SBGD.shape[0]
        if end > self.key_SBGD.shape[0]:
            raise ValueError(f"prompt state overflow: {end} tokens > {self.key_SBGD.shape[0]}")
        self.key_SBGD[self.length:end] = key_SBGD
        self.value_SBGD[self.length:end] = value_SBGD
        self.length = end

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The filled part of the pages."""
        return self.key_SBGD[: self.length], self.value_SBGD[: self.length]

    def write_at(self, start_t: torch.Tensor, key_SBGD: torch.Tensor, value_SBGD: torch.Tensor) -> None:
        """Write keys/values at the rows from ``start_t`` (a one-element device tensor) on: the
        fixed-shape append of ``Binding.static_decode``, whose count lives on the device (``length``,
        the Python count, is left alone)."""
        rows_S = start_t.reshape(()) + torch.arange(key_SBGD.shape[0], device=start_t.device)
        self.key_SBGD.index_copy_(0, rows_S, key_SBGD)
        self.value_SBGD.index_copy_(0, rows_S, value_SBGD)


@dataclass
class AttentionDecodeState(AttentionKVState):
    """Decode: the samples' own keys/values ``[capacity, samples, groups, d]`` (filled ``length``
    rows) after the shared batch-1 ``prompt`` pages, which are referenced, never copied."""

    prompt: Optional[AttentionKVState] = field(default=None, kw_only=True)


class SDPACoreAttention(MegatronModule, StatefulModule, UsesKernelOptions):
    """Core attention ``softmax(q k^T * scale) v`` with a causal mask and GQA.

    Takes ``query_SBHD`` ``[s, b, heads, d]`` and ``key/value_SBGD`` ``[s, b, groups, d]``;
    returns ``[s, b, heads * d_v]`` like Megatron's ``DotProductAttention``.
    """

    supports_context_parallel = True
    supports_prompt_gradient = True
    supports_static_decode = True
    capture_attention: Optional[Callable] = None
    """Computes the capture's attention in place of ``prefix_causal_attention`` when set (same
    arguments; without context parallelism): another numerics for the no-grad prompt pass only,
    e.g. the FP8 emulation (``testing/fp8_attention_emulation.py``)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"SDPACoreAttention supports causal masks only, got {attn_mask_type}")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.groups_per_rank = max(config.num_query_groups // tp, 1)

    def new_prompt_state(self, prompt_length: int, batch: int, device) -> AttentionKVState:
        """Empty K/V pages for ``prompt_length`` tokens of this rank's query groups."""
        shape = (prompt_length, batch, self.groups_per_rank, self.config.kv_channels)
        dtype = self.config.params_dtype
        return AttentionKVState(torch.empty(shape, dtype=dtype, device=device),
                                torch.empty(shape, dtype=dtype, device=device))

    def new_decode_state(self, prompt: AttentionKVState, num_samples: int,
                         capacity: int) -> AttentionDecodeState:
        """Per-sample pages for ``capacity`` decoded tokens after the shared ``prompt`` pages, zeros
        (a fixed-shape step, ``Binding.static_decode``, reads rows not yet written: masked out, but
        their weight 0 times a non-finite value would not be 0)."""
        shape = (capacity, num_samples, self.groups_per_rank, self.config.kv_channels)
        zeros = dict(dtype=prompt.key_SBGD.dtype, device=prompt.key_SBGD.device)
        return AttentionDecodeState(torch.zeros(shape, **zeros), torch.zeros(shape, **zeros), prompt=prompt)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **kwargs):
        """Causal attention of ``query`` over ``key``/``value``, or over the bound prompt state."""
        if packed_seq_params is not None:
            raise ValueError("SDPACoreAttention: packed sequences are not supported")
        binding = self.longstraw
        seq, batch = query.shape[0], query.shape[1]
        cp_group = context_parallel_group() if binding is not None else None
        if cp_group is not None:
            return self._forward_context_parallel(query, key, value, binding, cp_group).reshape(seq, batch, -1)
        if binding is not None and binding.mode == Mode.SWEEP:
            return self._forward_sweep(query, key, value, binding).reshape(seq, batch, -1)
        if binding is not None and binding.mode in (Mode.CAPTURE, Mode.REPLAY):
            prefix_k, prefix_v = binding.state.keys_values()
            if binding.mode == Mode.REPLAY and binding.exact:  # gradients into the pages' buffers
                grads = binding.state.grads
                prefix_k = read_with_grad(prefix_k, grads.buffer("key_SBGD")[:prefix_k.shape[0]])
                prefix_v = read_with_grad(prefix_v, grads.buffer("value_SBGD")[:prefix_v.shape[0]])
            attend = prefix_causal_attention
            if binding.mode == Mode.CAPTURE and self.capture_attention is not None:
                attend = self.capture_attention
            out_SBHD = attend(query, key, value, prefix_k, prefix_v, self.softmax_scale, options=self.kernel_options)
            if binding.mode == Mode.CAPTURE:  # not the sequence-parallel padding rows
                binding.state.append(key[:binding.valid_length], value[:binding.valid_length])
            return out_SBHD.reshape(seq, batch, -1)
        if binding is not None and binding.mode == Mode.DECODE:
            valid = binding.valid_length or seq  # sequence parallelism pads the tokens at the end
            state, static, own_valid = binding.state, binding.static_decode, None
            if static is None:
                state.append(key[:valid], value[:valid])
                own_k, own_v = state.keys_values()
            else:  # fixed shapes: the rows at the device count, the buffers' first rows masked
                state.write_at(static.length_t, key[:valid], value[:valid])
                own_k, own_v = state.key_SBGD[:static.rows], state.value_SBGD[:static.rows]
                own_valid = static.length_t + valid
            prompt_k, prompt_v = state.prompt.keys_values()
            out_SBHD = decode_attention(query[:valid], own_k, own_v, prompt_k, prompt_v, self.softmax_scale,
                                        options=self.kernel_options, own_valid=own_valid)
            return pad_rows_to(out_SBHD, seq).reshape(seq, batch, -1)
        if binding is not None and binding.mode == Mode.REFERENCE:
            key = detach_prefix(key, binding.prefix_length, 0)
            value = detach_prefix(value, binding.prefix_length, 0)
        q_BHSD, k_BGSD, v_BGSD = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out_BHSD = F.scaled_dot_product_attention(
            q_BHSD, k_BGSD, v_BGSD, is_causal=True, scale=self.softmax_scale,
            enable_gqa=q_BHSD.shape[1] != k_BGSD.shape[1],
        )
        return out_BHSD.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    def _forward_sweep(self, query, key, value, binding):
        """The reverse sweep's recomputed chunk (``Mode.SWEEP``): its queries over the pages of
        the positions before it (their gradients go into the pages' buffers) and its own keys;
        the chunk's own keys and values receive their pages' accumulated gradients."""
        state, grads = binding.state, binding.state.grads
        start, valid = binding.position_offset, binding.valid_length or query.shape[0]
        grad_k, grad_v = grads.buffer("key_SBGD"), grads.buffer("value_SBGD")
        prefix_k = read_with_grad(state.key_SBGD[:start], grad_k[:start])
        prefix_v = read_with_grad(state.value_SBGD[:start], grad_v[:start])
        out_SBHD = prefix_causal_attention(query, key, value, prefix_k, prefix_v, self.softmax_scale,
                                           options=self.kernel_options)
        binding.sweep.inject(key[:valid], grad_k[start:start + valid])
        binding.sweep.inject(value[:valid], grad_v[start:start + valid])
        return out_SBHD

    def _forward_sweep_context_parallel(self, query, key, value, binding, cp_group):
        """``Mode.SWEEP`` under CP: this rank's shard of the recomputed chunk, its queries
        travelling as in capture (``cp_sweep_attention``), over this rank's pages before the chunk
        (the first ``binding.local_offset`` rows; their gradients go into the pages' buffers) and
        its shard's own keys, which receive their pages' accumulated gradients."""
        state, grads = binding.state, binding.state.grads
        before, own = binding.local_offset, query.shape[0]
        grad_k, grad_v = grads.buffer("key_SBGD"), grads.buffer("value_SBGD")
        prefix_k = read_with_grad(state.key_SBGD[:before], grad_k[:before])
        prefix_v = read_with_grad(state.value_SBGD[:before], grad_v[:before])
        out_SBHD = cp_sweep_attention(query, key, value, prefix_k, prefix_v, binding.shard_sizes,
                                      self.softmax_scale, cp_group, options=self.kernel_options)
        binding.sweep.inject(key, grad_k[before:before + own])
        binding.sweep.inject(value, grad_v[before:before + own])
        return out_SBHD

    def _forward_context_parallel(self, query, key, value, binding, cp_group):
        """Capture / replay / decode with the pages sharded over ``cp_group``; ``[s, b, heads, d_v]``."""
        if binding.mode == Mode.CAPTURE:
            if binding.shard_sizes is None:
                raise ValueError("SDPACoreAttention: capture under context parallelism needs the "
                                 "chunk's shard sizes (use capture_prompt)")
            prefix_k, prefix_v = binding.state.keys_values()
            out_SBHD = cp_capture_attention(query, key, value, prefix_k, prefix_v, binding.shard_sizes,
                                            self.softmax_scale, cp_group, options=self.kernel_options)
            binding.state.append(key, value)
            return out_SBHD
        if binding.mode == Mode.SWEEP:
            return self._forward_sweep_context_parallel(query, key, value, binding, cp_group)
        if binding.mode == Mode.REPLAY:
            prefix_k, prefix_v = binding.state.keys_values()
            if binding.exact:  # gradients of this rank's pages into their buffers
                grads = binding.state.grads
                prefix_k = read_with_grad(prefix_k, grads.buffer("key_SBGD")[:prefix_k.shape[0]])
                prefix_v = read_with_grad(prefix_v, grads.buffer("value_SBGD")[:prefix_v.shape[0]])
            return cp_prefix_causal_attention(query, key, value, prefix_k, prefix_v, self.softmax_scale,
                                              cp_group, options=self.kernel_options)
        if binding.mode == Mode.DECODE:  # replicated samples over every rank's shard of the pages
            binding.state.append(key, value)
            own_k, own_v = binding.state.keys_values()
            prompt_k, prompt_v = binding.state.prompt.keys_values()
            return decode_attention(query, own_k, own_v, prompt_k, prompt_v, self.softmax_scale,
                                    cp_group=cp_group, options=self.kernel_options)
        raise ValueError("SDPACoreAttention: the full-graph baseline (--replay-mode full) is not "
                         f"supported with --context-parallel-size {cp_group.size()} > 1 yet")


@contextmanager
def capture_attention_as(model: torch.nn.Module, attend: Optional[Callable]):
    """Inside, every ``SDPACoreAttention`` of ``model`` computes its capture with ``attend``
    (its ``capture_attention`` hook; ``None``: the cores' own attention); the hooks are restored
    on exit. Yields the cores."""
    cores = [m for m in model.modules() if isinstance(m, SDPACoreAttention)]
    saved = [core.capture_attention for core in cores]
    for core in cores:
        core.capture_attention = attend
    try:
        yield cores
    finally:
        for core, hook in zip(cores, saved):
            core.capture_attention = hook
