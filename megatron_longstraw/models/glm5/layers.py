"""Small local-spec building blocks that GLM-5 (``glm_moe_dsa``) needs beyond Megatron's own.

Megatron's DSA spec (``get_dsa_module_spec_for_backend``) is written for Transformer Engine: the
indexer's projections are ``backend.linear()`` (``TELinear`` with ``parallel_mode="duplicated"``)
and the local ``LocalSpecProvider`` has no such linear; its ``WrappedTorchNorm`` also refuses
sequence parallelism, which Megatron's ``AbsorbedMLASelfAttention`` requires whenever TP > 1.
HF also builds the MLA latent norms (``q_a_layernorm``, ``kv_a_layernorm``) with a fixed
``eps=1e-6`` while Megatron passes ``config.layernorm_epsilon`` (GLM-5's ``rms_norm_eps`` is 1e-5).
These classes fill exactly those gaps; everything else is Megatron's.

``GlmAbsorbedMLASelfAttention`` exists for a gradient bug: with column-parallel down projections
(the only local choice Megatron's MLA accepts) and TP > 1, Megatron gathers ``kv_down``'s output
with ``gather_from_tensor_model_parallel_region``, whose backward only splits; the RoPE key
slice ``k_pos_emb`` then keeps just this rank's heads' share of its gradient (the latent part is
summed by the sequence-parallel gather, the RoPE part is not). Forward logits are right, input and
``kv_down`` gradients are not. Megatron's Transformer Engine spec avoids that path by using
duplicated down projections; the subclass does the same with ``DuplicatedLinear``.

LongStraw (capture/replay/decode/sweep, ``core/binding.py``): ``LongStrawAbsorbedMLASelfAttention``
owns the MLA latent state, ``LongStrawDSAIndexer`` the indexer keys (``models/glm5/state.py``), and
``LongStrawDSAttention`` attends new tokens over ``[prompt state; new tokens]``
(``prefix_sparse_attention``), or in decode over ``[shared prompt state; the sample's own
tokens]`` (``models/glm5/decode.py``); each has one method per mode (the MLA layer's ``forward_<mode>``
calls the DSA core's ``attend_<mode>``, which asks the indexer's ``topk``, dispatched to its
``topk_<mode>``). Under context parallelism capture, replay, the prompt sweep and decoding
select the top-k and attend over every CP rank's shard (``attention/cp_sparse_attention.py``),
each mode in its own CP branch; in decode every CP rank runs the same samples, whose own latents
and indexer keys are replicated. The full-graph baseline (``ReferenceBinding``) is refused under
CP.
The indexer and the sparse attention run their blockwise kernels with their ``kernel_options``
(``attention/kernel_options.py``), which the model build sets. Unbound, all three are
Megatron's modules unchanged.
"""

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.experimental_attention_variant.absorbed_mla import (
    AbsorbedMLASelfAttention,
    _apply_absorbed_v_up_projection,
)
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer, DSAttention
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_longstraw.attention.cp_sparse_attention import (
    chunk_query_positions, cp_index_topk, cp_sparse_latent_attention, cp_sweep_sparse_latent_attention, up_project)
from megatron_longstraw.attention.dsa_blockwise import index_topk_blockwise, sparse_latent_attention
from megatron_longstraw.attention.kernel_options import UsesKernelOptions
from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.core.binding import (
    CaptureBinding, DecodeBinding, ReferenceBinding, ReplayBinding, StatefulModule, SweepBinding, detach_prefix,
    pad_rows_to, read_state)
from megatron_longstraw.core.collectives import all_gather_rows, context_parallel_group
from megatron_longstraw.models.glm5.decode import decode_index_topk, decode_sparse_attention
from megatron_longstraw.models.glm5.state import (
    IndexerDecodeState, IndexerKeyState, MLADecodeState, MLALatentState)


class DuplicatedLinear(MegatronModule):
    """A linear layer whose full weight lives on every TP rank (local twin of ``TELinear``
    with ``parallel_mode="duplicated"``); returns ``(output, bias)`` like Megatron's linears."""

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig,
                 init_method=None, bias: bool = False, skip_bias_add: bool = False,
                 parallel_mode: str = "duplicated", **kwargs):
        super().__init__(config=config)
        if parallel_mode != "duplicated":
            raise ValueError(f"DuplicatedLinear supports parallel_mode='duplicated', got {parallel_mode!r}")
        if bias:
            raise ValueError("DuplicatedLinear: bias is not supported")
        device = None if config.use_cpu_initialization else torch.cuda.current_device()  # None: default
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size, dtype=config.params_dtype, device=device))
        if config.perform_initialization and init_method is not None:
            init_method(self.weight)
        # on sequence-parallel input each TP rank's gradient covers its own tokens: Megatron's
        # finalize_model_grads sums such weights over TP (the DSA indexer marks its duplicated
        # weights ``average_gradients_across_tp_domain`` instead, which takes precedence)
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)
        self.skip_bias_add = skip_bias_add

    def forward(self, x: torch.Tensor):
        """``x @ W^T`` and no bias."""
        return F.linear(x, self.weight), None

    def backward_dw(self) -> None:
        """No delayed weight-gradient computation (interface of Megatron's linears)."""


class _SingleRank:
    """Stands in for a process group of one: tells Megatron's RoPE not to take a CP slice."""

    @staticmethod
    def size() -> int:
        return 1


class RopeOffset:
    """Forward pre-hook on a Megatron ``RotaryEmbedding``: RoPE for the tokens a bound forward runs.

    Megatron's MLA and DSA indexer build their RoPE table from position 0 inside forward, and
    under context parallelism for ``len x cp`` positions of which they take this rank's
    load-balanced slice. Capture and replay run a slice of the sequence whose positions start at
    the binding's offset (``core/collectives.py`` lays the shards out contiguously),
    so inside ``shifted`` the table starts at ``offset`` and covers this rank's tokens only.
    Outside ``shifted`` Megatron's behaviour is unchanged.
    """

    def __init__(self, rotary_module: torch.nn.Module, context_parallel_size: int = 1):
        self.offset = None
        self.context_parallel_size = context_parallel_size
        rotary_module.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        if self.offset is None:
            return None
        max_seq_len = (args[0] if args else kwargs.pop("max_seq_len")) // self.context_parallel_size
        offset = (args[1] if len(args) > 1 else kwargs.pop("offset", 0)) + self.offset
        kwargs = {**kwargs, "cp_group": _SingleRank} if self.context_parallel_size > 1 else kwargs
        return (max_seq_len, offset) + tuple(args[2:]), kwargs

    @contextlib.contextmanager
    def shifted(self, offset: int):
        """RoPE at positions ``offset...`` (this rank's tokens) for the block."""
        self.offset = offset
        try:
            yield
        finally:
            self.offset = None


def _refuse_unsupported(what: str, packed_seq_params=None, inference_context=None) -> None:
    """``ValueError`` for packed sequences and Megatron's inference (bound forwards)."""
    if packed_seq_params is not None or inference_context is not None:
        raise ValueError(f"LongStraw {what}: packed sequences and inference are not supported")


def _decode_shard(binding: DecodeBinding, state, new_tokens: int) -> dict:
    """Decode under CP: the ``models/glm5/decode.py`` arguments of this rank's prompt shard (the
    CP group, its rows' global positions, and the prompt's length, i.e. the position of the
    samples' first own token: ``state`` already holds this step's ``new_tokens``); ``{}``
    without CP."""
    group = context_parallel_group()
    if group is None:
        return {}
    return dict(cp_group=group, prompt_pos_P=state.prompt.filled_positions(),
                prompt_length=binding.position_offset + new_tokens - state.length)


def prefix_sparse_attention(query_SBNK, key_SBK, prefix_key_SBK, topk_indices_BSK, up_v_weight,
                            softmax_scale: float, config, options: KernelOptions = KernelOptions()) -> torch.Tensor:
    """Absorbed-MLA sparse attention of new-token queries over ``[prefix latents; new latents]``.

    ``query_SBNK`` ``[s, b, heads, kv_lora_rank + rope]`` (absorbed, post-RoPE), ``key_SBK`` the new
    tokens' latents ``[s, b, kv_lora_rank + rope]``, ``prefix_key_SBK`` the prompt state's
    ``[p, b or 1, ...]`` (no gradient); ``topk_indices_BSK`` index ``[prefix; new]``, -1 for none.
    Each query attends to its selected keys only, gathered in blocks
    (``attention/dsa_blockwise.sparse_latent_attention``: Megatron's unfused absorbed math without
    its dense ``[heads, queries, keys]`` scores; blocks set by ``options``). Returns
    ``[s, b, heads * v]`` after the V up projection.
    """
    segments = [(prefix_key_SBK.to(key_SBK.dtype), 0), (key_SBK, prefix_key_SBK.shape[0])]
    return up_project(sparse_latent_attention(query_SBNK, segments, topk_indices_BSK, softmax_scale,
                                              config.kv_lora_rank, options), up_v_weight)


class LongStrawDSAIndexer(DSAIndexer, StatefulModule, UsesKernelOptions):
    """Megatron's ``DSAIndexer`` that can rank ``[prompt indexer keys; new keys]``.

    Its prompt state is the indexer key of every prompt token (``models/glm5/state.py``'s ``IndexerKeyState``).
    Its ``forward`` is Megatron's in every mode (``StatefulModule`` comes after ``DSAIndexer``):
    unbound, and under ``ReferenceBinding``, it is Megatron's indexer unchanged (its keys never
    carry gradient, so there is nothing to detach). Bound, ``LongStrawDSAttention`` asks it for
    ``topk``: one method per mode, ``topk_capture``, ``topk_replay``, ``topk_sweep``,
    ``topk_decode``, each with its CP branch (``cp_index_topk``: global top-k positions over
    every CP rank's keys).

    ``--prompt-gradient exact``: the top-k selection is not differentiable and Megatron computes
    the indexer from detached inputs, so in the full graph the loss sends no gradient to the
    indexer keys (nor to its parameters: only the indexer KL loss would, which capture/replay
    refuse). Its keys therefore have no gradient buffer; exact replay reads them as in detached
    replay, and the sweep's recomputed chunk ranks ``[prompt keys before the chunk; the chunk's
    keys]`` without grad and without appending: the selection of the capture.
    """

    supports_context_parallel = True
    supports_prompt_gradient = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rope_offset = RopeOffset(self.rotary_pos_emb, self.config.context_parallel_size)

    def new_prompt_state(self, prompt_length: int, batch: int, device) -> IndexerKeyState:
        """Empty key pages for ``prompt_length`` tokens."""
        return IndexerKeyState(torch.empty(prompt_length, batch, self.index_head_dim,
                                           dtype=self.config.params_dtype, device=device))

    def new_decode_state(self, prompt: IndexerKeyState, num_samples: int,
                         capacity: int) -> IndexerDecodeState:
        """Empty per-sample key pages for ``capacity`` decoded tokens after the shared ``prompt``."""
        return IndexerDecodeState(torch.empty(capacity, num_samples, self.index_head_dim,
                                              dtype=prompt.key_SBD.dtype, device=prompt.key_SBD.device),
                                  prompt=prompt)

    @torch.no_grad()
    def topk(self, x: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
        """The new tokens' top-k ``[b, s, topk]`` under the bound mode, causal:
        ``topk_<mode>(binding, x, qr)``."""
        binding = self.longstraw
        return self.mode_method("topk", binding)(binding, x, qr)

    def topk_capture(self, binding: CaptureBinding, x, qr) -> torch.Tensor:
        """The chunk's queries over ``[prompt keys so far; the chunk's keys]``, whose keys are
        then appended (not the sequence-parallel padding rows). Under CP all the chunk's queries
        (all-gathered) over every rank's keys."""
        state = binding.state
        q, k, weights = self._queries_keys(binding, x, qr)
        group = context_parallel_group()
        if group is None:
            topk = self._topk_local(q, k, weights, state.filled())
            state.append(k[:binding.valid_length])
            return topk
        topk = self._topk_chunk_cp(q, k, weights, binding, state.filled(), state.filled_positions(), group)
        state.append(k)
        return topk

    def topk_replay(self, binding: ReplayBinding, x, qr) -> torch.Tensor:
        """The response's queries over ``[prompt keys; its own keys]``; under CP the replicated
        response over every rank's keys plus its own."""
        state = binding.state
        q, k, weights = self._queries_keys(binding, x, qr)
        group = context_parallel_group()
        if group is None:
            return self._topk_local(q, k, weights, state.filled())
        query_pos = torch.arange(binding.position_offset, binding.position_offset + q.shape[0], device=q.device)
        return cp_index_topk(q, weights, [(state.filled(), state.filled_positions())], query_pos, self.index_topk,
                             int(query_pos[-1]) + 1, self.config.dsa_indexer_scoring_relu, group,
                             own_keys_TBD=k, own_pos_T=query_pos, options=self.kernel_options)

    def topk_sweep(self, binding: SweepBinding, x, qr) -> torch.Tensor:
        """The recomputed chunk's queries over ``[prompt keys before the chunk; the chunk's
        keys]``, not appended again (the capture's selection); under CP as in capture, over this
        rank's keys before the chunk's shard (its first ``local_offset`` rows)."""
        state, before = binding.state, binding.local_offset
        q, k, weights = self._queries_keys(binding, x, qr)
        group = context_parallel_group()
        if group is None:
            return self._topk_local(q, k, weights, state.key_SBD[:before])
        return self._topk_chunk_cp(q, k, weights, binding, state.filled()[:before],
                                   state.filled_positions()[:before], group)

    def topk_decode(self, binding: DecodeBinding, x, qr) -> torch.Tensor:
        """Appends the new tokens' keys to the samples' own keys; their top-k over ``[shared
        prompt keys; own keys]``. Under CP the prompt keys are this rank's shard and the top-k,
        chosen over every rank's (``decode_index_topk``), holds global positions."""
        state = binding.state
        q, k, weights = self._queries_keys(binding, x, qr)
        valid = binding.valid_length  # the real tokens (sequence parallelism pads)
        q, k, weights = q[:valid], k[:valid], weights[:valid]
        state.append(k)
        return decode_index_topk(q, weights, state.prompt.filled(), state.filled(), self.index_topk,
                                 use_relu=self.config.dsa_indexer_scoring_relu, options=self.kernel_options,
                                 **_decode_shard(binding, state, q.shape[0]))

    def _queries_keys(self, binding, x, qr):
        """Megatron's indexer queries, keys and weights of the new tokens, RoPE at their positions."""
        with self.rope_offset.shifted(binding.position_offset):
            return self.forward_before_topk(x, qr)

    def _topk_local(self, q, k, weights, keys_before_SBD) -> torch.Tensor:
        """Top-k of the queries over ``[keys_before; k]`` (without CP)."""
        before = keys_before_SBD.shape[0]
        return index_topk_blockwise(q, weights, [(keys_before_SBD, 0), (k, before)], before, self.index_topk,
                                    self.config.dsa_indexer_scoring_relu, self.kernel_options)

    def _topk_chunk_cp(self, q, k, weights, binding, pages, pages_pos, group) -> torch.Tensor:
        """Under CP, a chunk's (capture, sweep): global top-k positions of all the chunk's queries
        (all-gathered) over every rank's ``pages`` (at ``pages_pos``) and shard of the chunk."""
        sizes = binding.shard_sizes
        _, query_pos = chunk_query_positions(binding, group, q.device)
        own_pos = torch.arange(binding.position_offset, binding.position_offset + k.shape[0], device=q.device)
        return cp_index_topk(torch.cat(all_gather_rows(q, sizes, group)),
                             torch.cat(all_gather_rows(weights, sizes, group)),
                             [(pages, pages_pos), (k, own_pos)], query_pos, self.index_topk, int(query_pos[-1]) + 1,
                             self.config.dsa_indexer_scoring_relu, group, options=self.kernel_options)


class LongStrawDSAttention(DSAttention, UsesKernelOptions):
    """Megatron's ``DSAttention`` plus one method per mode for capture/replay/sweep/decode.

    The MLA layer that owns the latents calls the method of its mode, ``attend_<mode>``, with
    its binding and its pages; the top-k comes from this layer's ``LongStrawDSAIndexer`` or, for
    a shared layer, from its source layer's selection in the same forward, exactly as in
    Megatron's forward (same holder). Under ``ReferenceBinding`` Megatron's ``forward`` runs.
    """

    def _topk(self, x, qr):
        """This layer's top-k from its indexer (``LongStrawDSAIndexer.topk``), or its source
        layer's when shared."""
        holder = self._get_index_share_topk_holder(None, None) if self.index_share else None
        if self.skip_topk:
            if self.source_layer not in holder:
                raise RuntimeError(f"DSA shared layer {self.layer_number}: source layer "
                                   f"{self.source_layer} did not run before it")
            return holder[self.source_layer]
        topk = self.indexer.topk(x, qr)
        if holder is not None:
            holder[self.layer_number] = topk
        return topk

    def _prefix_topk(self, x, qr):
        """``_topk`` of capture, replay and the sweep, from detached inputs (no indexer loss)."""
        if self.training and torch.is_grad_enabled() and (self.config.dsa_indexer_loss_coeff or 0) > 0:
            raise ValueError("LongStraw DSA: the indexer KL loss (--dsa-indexer-loss-coeff > 0) is "
                             "not supported in capture/replay")
        return self._topk(x.detach(), qr.detach())

    def attend_capture(self, binding: CaptureBinding, query_SBNK, key_SBK, pages_SBK, x, qr, up_v_weight):
        """The chunk's attention over ``[pages; its own latents]``; ``[s, b, heads * v]``. Under
        CP all the chunk's queries (all-gathered) over this rank's pages and shard of the chunk,
        merged over the group; this rank's rows returned."""
        topk = self._prefix_topk(x, qr)
        group = context_parallel_group()
        if group is None:
            return prefix_sparse_attention(query_SBNK, key_SBK, pages_SBK, topk, up_v_weight, self.softmax_scale,
                                           self.config, self.kernel_options)
        mine, _ = chunk_query_positions(binding, group, query_SBNK.device)
        out = cp_sparse_latent_attention(
            torch.cat(all_gather_rows(query_SBNK, binding.shard_sizes, group)),
            [_positioned(binding, pages_SBK), (key_SBK, _own_positions(binding, key_SBK))], topk,
            self.softmax_scale, self.config.kv_lora_rank, group,
            options=self.kernel_options)[mine:mine + key_SBK.shape[0]]
        return up_project(out, up_v_weight)

    def attend_replay(self, binding: ReplayBinding, query_SBNK, key_SBK, pages_SBK, x, qr, up_v_weight):
        """The response's attention over ``[pages; its own latents]``; under CP the replicated
        response over every rank's pages plus its own latents."""
        topk = self._prefix_topk(x, qr)
        group = context_parallel_group()
        if group is None:
            return prefix_sparse_attention(query_SBNK, key_SBK, pages_SBK, topk, up_v_weight, self.softmax_scale,
                                           self.config, self.kernel_options)
        out = cp_sparse_latent_attention(query_SBNK, [_positioned(binding, pages_SBK)], topk, self.softmax_scale,
                                         self.config.kv_lora_rank, group, own_keys_TBK=key_SBK,
                                         own_pos_T=_own_positions(binding, key_SBK), options=self.kernel_options)
        return up_project(out, up_v_weight)

    def attend_sweep(self, binding: SweepBinding, query_SBNK, key_SBK, pages_SBK, x, qr, up_v_weight):
        """The recomputed chunk's attention over ``[pages before it; its own latents]``, with
        autograd; under CP as in capture (``cp_sweep_sparse_latent_attention``)."""
        topk = self._prefix_topk(x, qr)
        group = context_parallel_group()
        if group is None:
            return prefix_sparse_attention(query_SBNK, key_SBK, pages_SBK, topk, up_v_weight, self.softmax_scale,
                                           self.config, self.kernel_options)
        out = cp_sweep_sparse_latent_attention(
            query_SBNK, [_positioned(binding, pages_SBK), (key_SBK, _own_positions(binding, key_SBK))], topk,
            self.softmax_scale, self.config.kv_lora_rank, binding.shard_sizes, group, options=self.kernel_options)
        return up_project(out, up_v_weight)

    @torch.no_grad()
    def attend_decode(self, binding: DecodeBinding, query_SBNK, latents: MLADecodeState, x, qr, up_v_weight):
        """The newest tokens' attention over ``[shared prompt latents; the samples' own
        latents]`` (the new ones already appended to ``latents``); ``[s, b, heads * v]``. Under
        CP the prompt latents are this rank's shard and the partials merge over the group
        (``decode_sparse_attention``)."""
        topk = self._topk(x, qr)
        return decode_sparse_attention(query_SBNK, latents.prompt.filled(), latents.filled(), topk,
                                       up_v_weight, self.softmax_scale, self.config.kv_lora_rank,
                                       options=self.kernel_options,
                                       **_decode_shard(binding, latents, query_SBNK.shape[0]))


def _positioned(binding, pages_SBK) -> tuple:
    """Under CP: this rank's ``pages_SBK`` (the first rows of its latents) with their global
    positions."""
    return pages_SBK, binding.state.filled_positions()[:pages_SBK.shape[0]]


def _own_positions(binding, key_SBK) -> torch.Tensor:
    """The global positions of this forward's own latents."""
    return torch.arange(binding.position_offset, binding.position_offset + key_SBK.shape[0], device=key_SBK.device)


class LongStrawAbsorbedMLASelfAttention(StatefulModule, AbsorbedMLASelfAttention):
    """Megatron's ``AbsorbedMLASelfAttention`` with the MLA latent as LongStraw prompt state.

    Unbound: Megatron's forward. Bound (``core/binding.py``), one method per mode, RoPE starting
    at the binding's ``position_offset``: capture attends the chunk over the latents captured so
    far plus itself and appends its latents; replay attends the response over the prompt latents
    plus itself; decode appends each sample's new latents to its own and attends over the shared
    prompt latents plus its own; the reference mode is the ordinary full-sequence forward with
    the prompt rows of the latent (``c_kv`` and ``k_rope``, the core attention's key) detached.
    The core attention must be ``LongStrawDSAttention`` (its ``attend_<mode>``).

    ``--prompt-gradient exact`` (``core/state_grad.py``): exact replay reads the prompt latents
    with gradients into their buffer (``read_state``); the sweep attends the recomputed chunk
    over ``[latents before the chunk (read with gradients); its own latents]`` and injects the
    own latents' accumulated gradients. The latents are the whole MLA state (what the reference
    mode detaches); no chunk-start state is needed.
    """

    supports_context_parallel = True
    supports_prompt_gradient = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rope_offset = RopeOffset(self.rotary_pos_emb, self.config.context_parallel_size)

    def new_prompt_state(self, prompt_length: int, batch: int, device) -> MLALatentState:
        """Empty latent pages for ``prompt_length`` tokens."""
        width = self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim
        return MLALatentState(torch.empty(prompt_length, batch, width, dtype=self.config.params_dtype,
                                          device=device), self.config.kv_lora_rank)

    def new_decode_state(self, prompt: MLALatentState, num_samples: int, capacity: int) -> MLADecodeState:
        """Empty per-sample latent pages for ``capacity`` decoded tokens after the shared ``prompt``."""
        width = self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim
        return MLADecodeState(torch.empty(capacity, num_samples, width, dtype=prompt.latent_SBD.dtype,
                                          device=prompt.latent_SBD.device),
                              self.config.kv_lora_rank, prompt=prompt)

    def forward_bound(self, binding, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                      rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
                      rotary_pos_cos_sin=None, attention_bias=None, packed_seq_params=None,
                      position_ids=None, sequence_len_offset=None, *, inference_params=None):
        """The mode's method, ``forward_<mode>(binding, hidden_states, v_up_weight, ...)`` (the
        core attention's output), then Megatron's V up projection and output projection."""
        _refuse_unsupported("MLA", packed_seq_params, inference_context or inference_params)
        if self.config.apply_rope_fusion or self.recompute_up_proj:
            raise ValueError("LongStraw MLA: --apply-rope-fusion and mla_up_proj recompute are not "
                             "supported in capture/replay")
        if not isinstance(self.core_attention, LongStrawDSAttention):
            raise TypeError("LongStraw MLA needs LongStrawDSAttention as core attention")
        v_up_weight = self._get_v_up_weight()
        core_out = super().forward_bound(binding, hidden_states, v_up_weight, attention_mask=attention_mask,
                                         position_ids=position_ids)
        core_out = _apply_absorbed_v_up_projection(
            core_out, v_up_weight, self.num_attention_heads_per_partition, self.config.kv_lora_rank,
            self.config.v_head_dim, getattr(self.core_attention, "consumes_absorbed_v_up_projection", False))
        return self.linear_proj(core_out)

    def forward_capture(self, binding: CaptureBinding, hidden_states, v_up_weight, **_):
        """The chunk over the latents so far plus its own, which are then appended (not the
        sequence-parallel padding rows)."""
        state = binding.state
        self._check_position(binding, state.length)
        query_SBNK, key_SBK, qr = self._project(hidden_states, binding.position_offset)
        core_out = self.core_attention.attend_capture(binding, query_SBNK, key_SBK, state.filled(), hidden_states,
                                                      qr, v_up_weight)
        state.append(key_SBK[:binding.valid_length])
        return core_out

    def forward_replay(self, binding: ReplayBinding, hidden_states, v_up_weight, **_):
        """The response over the prompt latents (with gradients into their buffer in exact
        replay) plus its own."""
        state = binding.state
        self._check_position(binding, state.length)
        query_SBNK, key_SBK, qr = self._project(hidden_states, binding.position_offset)
        pages_SBK = read_state(binding, "latent_SBD", state.length)
        return self.core_attention.attend_replay(binding, query_SBNK, key_SBK, pages_SBK, hidden_states, qr,
                                                 v_up_weight)

    def forward_decode(self, binding: DecodeBinding, hidden_states, v_up_weight, **_):
        """Each sample's new latents appended to its own (the first ``valid_length`` rows:
        sequence parallelism pads the tokens at the end), attending over the shared prompt
        latents plus its own."""
        state = binding.state
        self._check_position(binding, state.length + state.prompt.length)
        query_SBNK, key_SBK, qr = self._project(hidden_states, binding.position_offset)
        valid = binding.valid_length
        state.append(key_SBK[:valid])
        core_out = self.core_attention.attend_decode(binding, query_SBNK[:valid], state, hidden_states, qr,
                                                     v_up_weight)
        return pad_rows_to(core_out, query_SBNK.shape[0])

    def forward_sweep(self, binding: SweepBinding, hidden_states, v_up_weight, **_):
        """The reverse sweep's recomputed chunk: its queries over the latents before it (this
        rank's first ``local_offset`` rows, read with gradients into the latents' buffer) and its
        own latents, which receive their rows' accumulated gradients; ``[s, b, heads * v]``.
        Under CP the chunk is this rank's shard (the queries travel:
        ``cp_sweep_sparse_latent_attention``)."""
        state, start, valid = binding.state, binding.local_offset, binding.valid_length
        query_SBNK, key_SBK, qr = self._project(hidden_states, binding.position_offset)
        if start + valid > state.length:
            raise RuntimeError(f"LongStraw MLA: swept chunk [{start}, {start + valid}) beyond the "
                               f"{state.length} captured tokens")
        pages_SBK = read_state(binding, "latent_SBD", start)
        core_out = self.core_attention.attend_sweep(binding, query_SBNK, key_SBK, pages_SBK, hidden_states, qr,
                                                    v_up_weight)
        binding.targets.inject(key_SBK[:valid], state.grads.buffer("latent_SBD")[start:start + valid])
        return core_out

    def forward_reference(self, binding: ReferenceBinding, hidden_states, v_up_weight, attention_mask,
                          position_ids):
        """Megatron's core attention over the whole sequence, the prompt rows of the latent
        detached; not under CP."""
        if self.pg_collection.cp.size() > 1:
            raise ValueError("LongStraw MLA: under context parallelism the full-graph baseline "
                             "(--replay-mode full) is not supported (mode reference)")
        query_SBNK, key_SB1K, qr = self._project(hidden_states, 0, squeeze=False)
        return self.core_attention(
            query_SBNK, detach_prefix(key_SB1K, binding.prefix_length, 0), value=None,
            attention_mask=attention_mask, x=hidden_states, qr=qr, up_v_weight=v_up_weight,
            position_ids=position_ids, attn_mask_type=self.attn_mask_type)

    def _project(self, hidden_states, position_offset: int, squeeze: bool = True):
        """Megatron's absorbed queries, latents (``[s, b, d]``; ``squeeze=False``: its
        ``[s, b, 1, d]``) and compressed queries, RoPE at positions from ``position_offset``."""
        with self.rope_offset.shifted(position_offset):
            query_SBNK, key_SB1K, qr = self.get_query_key_value_tensors(hidden_states)
        return query_SBNK, key_SB1K.squeeze(2) if squeeze else key_SB1K, qr

    def _check_position(self, binding, tokens_before: int) -> None:
        """``RuntimeError`` unless the binding's position offset is ``tokens_before``, the tokens
        in the state (without CP, where the state's rows are the positions)."""
        if context_parallel_group() is None and binding.position_offset != tokens_before:
            raise RuntimeError(f"LongStraw MLA: position offset {binding.position_offset} != "
                               f"{tokens_before} tokens in the state")


class GlmAbsorbedMLASelfAttention(LongStrawAbsorbedMLASelfAttention):
    """``AbsorbedMLASelfAttention`` that also accepts ``DuplicatedLinear`` down projections.

    Megatron only accepts TE/ColumnParallel down projections and would, with ColumnParallel,
    lose part of the RoPE-key gradient under TP (module docstring). This subclass builds the
    parent with ColumnParallel placeholders and swaps in ``DuplicatedLinear``: the forward then
    takes Megatron's duplicated-projection branch, exactly as with ``TELinear`` under TE.
    """

    _DOWN_PROJECTIONS = ("linear_q_down_proj", "linear_kv_down_proj")

    def __init__(self, config, submodules, *args, **kwargs):
        swap = [name for name in self._DOWN_PROJECTIONS if getattr(submodules, name) is DuplicatedLinear]
        placeholders = dataclasses.replace(submodules, **{name: ColumnParallelLinear for name in swap})
        super().__init__(config, placeholders, *args, **kwargs)
        sizes = {"linear_q_down_proj": config.q_lora_rank,
                 "linear_kv_down_proj": config.kv_lora_rank + config.qk_pos_emb_head_dim}
        for name in swap:
            setattr(self, name, DuplicatedLinear(config.hidden_size, sizes[name], config=config,
                                                 init_method=config.init_method))


class IndexerLayerNorm:
    """``torch.nn.LayerNorm`` (with bias) for the DSA indexer's ``k_norm``.

    Unlike ``WrappedTorchNorm`` it does not refuse sequence parallelism: the indexer gathers the
    sequence before ``k_norm``, so its weights are plain duplicated parameters.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **kwargs):
        device = None if config.use_cpu_initialization else torch.cuda.current_device()  # None: default
        return torch.nn.LayerNorm(hidden_size, eps=eps, device=device, dtype=config.params_dtype)


class _FixedEpsNorm:
    norm = None
    eps = None

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = None, **kwargs):
        return cls.norm(config=config, hidden_size=hidden_size, eps=cls.eps, **kwargs)


def fixed_eps_norm(norm, eps: float) -> type:
    """A norm builder that always uses ``eps`` whatever epsilon the caller passes."""
    name = f"{getattr(norm, '__name__', 'Norm')}Eps{eps:g}"
    return type(name, (_FixedEpsNorm,), {"norm": staticmethod(norm), "eps": eps})
