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
from megatron_longstraw.core.binding import (
    CaptureBinding, DecodeBinding, ReferenceBinding, ReplayBinding, StatefulModule, SweepBinding, detach_prefix,
    pad_rows_to, read_state)
from megatron_longstraw.core.collectives import context_parallel_group
from megatron_longstraw.core.state import LayerState


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
        fixed-shape append of ``DecodeBinding.static_decode``, whose count lives on the device
        (``length``, the Python count, is left alone)."""
        rows_S = start_t.reshape(()) + torch.arange(key_SBGD.shape[0], device=start_t.device)
        self.key_SBGD.index_copy_(0, rows_S, key_SBGD)
        self.value_SBGD.index_copy_(0, rows_S, value_SBGD)


@dataclass
class AttentionDecodeState(AttentionKVState):
    """Decode: the samples' own keys/values ``[capacity, samples, groups, d]`` (filled ``length``
    rows) after the shared batch-1 ``prompt`` pages, which are referenced, never copied."""

    prompt: Optional[AttentionKVState] = field(default=None, kw_only=True)


class SDPACoreAttention(StatefulModule, MegatronModule, UsesKernelOptions):
    """Core attention ``softmax(q k^T * scale) v`` with a causal mask and GQA.

    Takes ``query_SBHD`` ``[s, b, heads, d]`` and ``key/value_SBGD`` ``[s, b, groups, d]``;
    returns ``[s, b, heads * d_v]`` like Megatron's ``DotProductAttention``. Unbound it is plain
    causal attention; bound, one method per mode (``core/binding.py``), each with its
    context-parallel branch.
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
        (a fixed-shape step, ``DecodeBinding.static_decode``, reads rows not yet written: masked
        out, but their weight 0 times a non-finite value would not be 0)."""
        shape = (capacity, num_samples, self.groups_per_rank, self.config.kv_channels)
        zeros = dict(dtype=prompt.key_SBGD.dtype, device=prompt.key_SBGD.device)
        return AttentionDecodeState(torch.zeros(shape, **zeros), torch.zeros(shape, **zeros), prompt=prompt)

    def forward_unbound(self, query, key, value, attention_mask=None, attn_mask_type=None,
                        attention_bias=None, packed_seq_params=None, **kwargs):
        """Causal attention of ``query`` over ``key``/``value``."""
        _refuse_packed(packed_seq_params)
        return self._causal_attention(query, key, value).reshape(query.shape[0], query.shape[1], -1)

    def forward_bound(self, binding, query, key, value, attention_mask=None, attn_mask_type=None,
                      attention_bias=None, packed_seq_params=None, **kwargs):
        """The mode's method on ``(query, key, value)``; its ``[s, b, heads, d_v]`` as ``[s, b, heads * d_v]``."""
        _refuse_packed(packed_seq_params)
        return super().forward_bound(binding, query, key, value).reshape(query.shape[0], query.shape[1], -1)

    def forward_capture(self, binding: CaptureBinding, query, key, value):
        """The chunk's queries over the pages so far and its own keys; its keys and values are
        appended to the pages (not the sequence-parallel padding rows). Under CP all the chunk's
        queries travel over every rank's pages and shard (``cp_capture_attention``)."""
        prefix_k, prefix_v = binding.state.keys_values()
        group = context_parallel_group()
        if group is None:
            attend = prefix_causal_attention if self.capture_attention is None else self.capture_attention
            out_SBHD = attend(query, key, value, prefix_k, prefix_v, self.softmax_scale, options=self.kernel_options)
            binding.state.append(key[:binding.valid_length], value[:binding.valid_length])
            return out_SBHD
        if binding.shard_sizes is None:
            raise ValueError("SDPACoreAttention: capture under context parallelism needs the "
                             "chunk's shard sizes (use capture_prompt)")
        out_SBHD = cp_capture_attention(query, key, value, prefix_k, prefix_v, binding.shard_sizes,
                                        self.softmax_scale, group, options=self.kernel_options)
        binding.state.append(key, value)
        return out_SBHD

    def forward_replay(self, binding: ReplayBinding, query, key, value):
        """The response's queries over the prompt pages (with gradients into their buffers in
        exact replay, ``read_state``) and its own keys; under CP over every rank's pages."""
        length = binding.state.length
        prefix_k, prefix_v = read_state(binding, "key_SBGD", length), read_state(binding, "value_SBGD", length)
        group = context_parallel_group()
        if group is None:
            return prefix_causal_attention(query, key, value, prefix_k, prefix_v, self.softmax_scale,
                                           options=self.kernel_options)
        return cp_prefix_causal_attention(query, key, value, prefix_k, prefix_v, self.softmax_scale,
                                          group, options=self.kernel_options)

    def forward_decode(self, binding: DecodeBinding, query, key, value):
        """Each sample appends its new keys/values to its own pages and attends over the shared
        prompt pages plus its own (``decode_attention``); in fixed shapes
        (``DecodeBinding.static_decode``) at the device count's rows. Under CP the replicated
        samples attend over every rank's shard of the prompt pages."""
        state, seq = binding.state, query.shape[0]
        group = context_parallel_group()
        if group is not None:
            state.append(key, value)
            own_k, own_v = state.keys_values()
            prompt_k, prompt_v = state.prompt.keys_values()
            return decode_attention(query, own_k, own_v, prompt_k, prompt_v, self.softmax_scale,
                                    cp_group=group, options=self.kernel_options)
        valid, static, own_valid = binding.valid_length, binding.static_decode, None
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
        return pad_rows_to(out_SBHD, seq)

    def forward_sweep(self, binding: SweepBinding, query, key, value):
        """The reverse sweep's recomputed chunk: its queries over the pages before it (the first
        ``local_offset`` rows, read with gradients into the pages' buffers) and its own keys,
        which receive their pages' accumulated gradients. Under CP the chunk is this rank's
        shard, its queries travelling as in capture (``cp_sweep_attention``)."""
        before = binding.local_offset
        prefix_k, prefix_v = read_state(binding, "key_SBGD", before), read_state(binding, "value_SBGD", before)
        group = context_parallel_group()
        if group is None:
            out_SBHD = prefix_causal_attention(query, key, value, prefix_k, prefix_v, self.softmax_scale,
                                               options=self.kernel_options)
            key, value = key[:binding.valid_length], value[:binding.valid_length]
        else:
            out_SBHD = cp_sweep_attention(query, key, value, prefix_k, prefix_v, binding.shard_sizes,
                                          self.softmax_scale, group, options=self.kernel_options)
        grads = binding.state.grads
        binding.targets.inject(key, grads.buffer("key_SBGD")[before:before + key.shape[0]])
        binding.targets.inject(value, grads.buffer("value_SBGD")[before:before + value.shape[0]])
        return out_SBHD

    def forward_reference(self, binding: ReferenceBinding, query, key, value):
        """Causal attention with the prompt rows of the keys and values detached; not under CP."""
        group = context_parallel_group()
        if group is not None:
            raise ValueError("SDPACoreAttention: the full-graph baseline (--replay-mode full) is not "
                             f"supported with --context-parallel-size {group.size()} > 1 yet")
        prefix = binding.prefix_length
        return self._causal_attention(query, detach_prefix(key, prefix, 0), detach_prefix(value, prefix, 0))

    def _causal_attention(self, query, key, value):
        """Torch SDPA, causal, with GQA; ``[s, b, heads, d_v]``."""
        q_BHSD, k_BGSD, v_BGSD = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out_BHSD = F.scaled_dot_product_attention(
            q_BHSD, k_BGSD, v_BGSD, is_causal=True, scale=self.softmax_scale,
            enable_gqa=q_BHSD.shape[1] != k_BGSD.shape[1],
        )
        return out_BHSD.permute(2, 0, 1, 3)


def _refuse_packed(packed_seq_params) -> None:
    """``ValueError`` for packed sequences."""
    if packed_seq_params is not None:
        raise ValueError("SDPACoreAttention: packed sequences are not supported")


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
