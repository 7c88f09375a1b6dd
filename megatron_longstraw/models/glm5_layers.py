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

LongStraw (capture/replay/decode, ``longstraw.binding``): ``LongStrawAbsorbedMLASelfAttention``
owns the MLA latent state, ``LongStrawDSAIndexer`` the indexer keys (``glm5_state``), and
``LongStrawDSAttention`` attends new tokens over ``[prompt state; new tokens]``
(``prefix_sparse_attention``), or in decode over ``[shared prompt state; the sample's own
tokens]`` (``glm5_decode``). Under context parallelism capture, replay, the prompt sweep and
decoding select the top-k and attend over every CP rank's shard
(``attention/cp_sparse_attention.py``); in decode every CP rank runs the same samples, whose own
latents and indexer keys are replicated. The full-graph baseline (``Mode.REFERENCE``) is refused
under CP.
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
from megatron_longstraw.attention.kernel_options import KernelOptions, UsesKernelOptions
from megatron_longstraw.core.binding import Mode, StatefulModule, detach_prefix, pad_rows_to
from megatron_longstraw.core.collectives import all_gather_rows, context_parallel_group
from megatron_longstraw.core.state_grad import read_with_grad
from megatron_longstraw.models.glm5_decode import decode_index_topk, decode_sparse_attention
from megatron_longstraw.models.glm5_state import (
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


def _refuse_unsupported(module, what: str, packed_seq_params=None, inference_context=None, mode=None) -> None:
    if packed_seq_params is not None or inference_context is not None:
        raise ValueError(f"LongStraw {what}: packed sequences and inference are not supported")
    if module.pg_collection.cp.size() > 1 and mode not in (Mode.CAPTURE, Mode.REPLAY, Mode.SWEEP, Mode.DECODE):
        raise ValueError(f"LongStraw {what}: under context parallelism the full-graph baseline "
                         f"(--replay-mode full) is not supported (mode {getattr(mode, 'value', mode)})")


def _decode_shard(binding, state, new_tokens: int) -> dict:
    """``Mode.DECODE`` under CP: the ``glm5_decode`` arguments of this rank's prompt shard (the
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

    Its prompt state is the indexer key of every prompt token (``glm5_state.IndexerKeyState``).
    Unbound, and in ``Mode.REFERENCE``, it is Megatron's indexer unchanged (its keys never carry
    gradient, so there is nothing to detach).

    ``--prompt-gradient exact``: the top-k selection is not differentiable and Megatron computes
    the indexer from detached inputs, so in the full graph the loss sends no gradient to the
    indexer keys (nor to its parameters: only the indexer KL loss would, which capture/replay
    refuse). Its keys therefore have no gradient buffer; exact replay reads them as in detached
    replay, and in ``Mode.SWEEP`` the recomputed chunk ranks ``[prompt keys before the chunk;
    the chunk's keys]`` without grad and without appending: the selection of the capture.
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
    def topk_decode(self, x: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
        """Bound in ``Mode.DECODE``: appends the new tokens' keys to the samples' own keys and
        returns their top-k ``[b, s, topk]`` over ``[shared prompt keys; own keys]``, causal.
        Under CP the prompt keys are this rank's shard and the top-k, chosen over every rank's
        (``decode_index_topk``), holds global positions."""
        binding = self.longstraw
        state = binding.state
        with self.rope_offset.shifted(binding.position_offset):
            q, k, weights = self.forward_before_topk(x, qr)
        valid = binding.valid_length or q.shape[0]  # the real tokens (sequence parallelism pads)
        q, k, weights = q[:valid], k[:valid], weights[:valid]
        state.append(k)
        return decode_index_topk(q, weights, state.prompt.filled(), state.filled(), self.index_topk,
                                 use_relu=self.config.dsa_indexer_scoring_relu, options=self.kernel_options,
                                 **_decode_shard(binding, state, q.shape[0]))

    @torch.no_grad()
    def topk_after_prefix(self, x: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
        """Top-k ``[b, s, topk]`` of the new tokens over ``[prompt keys; new keys]``, causal.

        Bound in ``Mode.CAPTURE`` it then appends the new keys to the state. In ``Mode.SWEEP``
        (a prompt chunk recomputed) the prompt keys are those before the chunk, which is not
        appended again: the capture's selection.
        """
        binding = self.longstraw
        state = binding.state
        with self.rope_offset.shifted(binding.position_offset):
            q, k, weights = self.forward_before_topk(x, qr)
        group = context_parallel_group()
        if group is not None:
            return self._topk_context_parallel(q, k, weights, binding, group)
        before = binding.position_offset if binding.mode == Mode.SWEEP else state.length
        topk = index_topk_blockwise(q, weights, [(state.key_SBD[:before], 0), (k, before)], before,
                                    self.index_topk, self.config.dsa_indexer_scoring_relu, self.kernel_options)
        if binding.mode == Mode.CAPTURE:  # not the sequence-parallel padding rows
            state.append(k[:binding.valid_length])
        return topk

    def _topk_context_parallel(self, q, k, weights, binding, group):
        """Global top-k positions over every CP rank's keys (``cp_index_topk``): in CAPTURE for all
        of the chunk's queries (all-gathered), in SWEEP the same over the keys before the chunk
        (not appended again), in REPLAY for the replicated response."""
        state, relu = binding.state, self.config.dsa_indexer_scoring_relu
        pages, pages_pos = state.filled(), state.filled_positions()
        if binding.mode == Mode.SWEEP:  # this rank's keys before the chunk's shard
            pages, pages_pos = pages[:binding.local_offset], pages_pos[:binding.local_offset]
        if binding.mode in (Mode.CAPTURE, Mode.SWEEP):
            sizes = binding.shard_sizes
            _, query_pos = chunk_query_positions(binding, group, q.device)
            own_pos = torch.arange(binding.position_offset, binding.position_offset + k.shape[0], device=q.device)
            topk = cp_index_topk(torch.cat(all_gather_rows(q, sizes, group)),
                                 torch.cat(all_gather_rows(weights, sizes, group)),
                                 [(pages, pages_pos), (k, own_pos)], query_pos,
                                 self.index_topk, int(query_pos[-1]) + 1, relu, group, options=self.kernel_options)
            if binding.mode == Mode.CAPTURE:
                state.append(k)
            return topk
        query_pos = torch.arange(binding.position_offset, binding.position_offset + q.shape[0], device=q.device)
        return cp_index_topk(q, weights, [(pages, pages_pos)], query_pos, self.index_topk, int(query_pos[-1]) + 1,
                             relu, group, own_keys_TBD=k, own_pos_T=query_pos, options=self.kernel_options)


class LongStrawDSAttention(DSAttention, UsesKernelOptions):
    """Megatron's ``DSAttention`` plus ``forward_after_prefix`` for capture/replay.

    The prompt latents are passed in by the MLA layer that owns them; the top-k comes from this
    layer's ``LongStrawDSAIndexer`` or, for a shared layer, from its source layer's selection in
    the same forward, exactly as in Megatron's forward (same holder).
    """

    def _topk(self, x, qr, select):
        """This layer's top-k from ``select(x, qr)`` (its indexer), or its source layer's when shared."""
        holder = self._get_index_share_topk_holder(None, None) if self.index_share else None
        if self.skip_topk:
            if self.source_layer not in holder:
                raise RuntimeError(f"DSA shared layer {self.layer_number}: source layer "
                                   f"{self.source_layer} did not run before it")
            return holder[self.source_layer]
        topk = select(x, qr)
        if holder is not None:
            holder[self.layer_number] = topk
        return topk

    def forward_after_prefix(self, query_SBNK, key_SB1K, prefix_key_SBK, x, qr, up_v_weight, binding=None):
        """New tokens' attention over ``[prompt latents; new latents]``; ``[s, b, heads * v]``.

        ``binding``: the MLA layer's (its state holds the latents); needed under CP only.
        """
        _refuse_unsupported(self, "DSA", mode=getattr(binding, "mode", None))
        if self.training and torch.is_grad_enabled() and (self.config.dsa_indexer_loss_coeff or 0) > 0:
            raise ValueError("LongStraw DSA: the indexer KL loss (--dsa-indexer-loss-coeff > 0) is "
                             "not supported in capture/replay")
        topk = self._topk(x.detach(), qr.detach(), lambda x, qr: self.indexer.topk_after_prefix(x, qr))
        group = context_parallel_group()
        if group is not None:
            return self._attention_context_parallel(query_SBNK, key_SB1K.squeeze(2), prefix_key_SBK, topk,
                                                    up_v_weight, binding, group)
        return prefix_sparse_attention(query_SBNK, key_SB1K.squeeze(2), prefix_key_SBK, topk,
                                       up_v_weight, self.softmax_scale, self.config, self.kernel_options)

    def _attention_context_parallel(self, query_SBNK, key_SBK, pages_SBK, topk_BSK, up_v_weight, binding, group):
        """``cp_sparse_latent_attention`` over every CP rank's latents: in CAPTURE all the chunk's
        queries over this rank's pages ``pages_SBK`` (its first rows) and shard of the chunk (this
        rank's rows returned), in SWEEP the same with autograd (``cp_sweep_sparse_latent_attention``),
        in REPLAY the replicated response over the pages plus its own latents."""
        v_channels = self.config.kv_lora_rank
        pages = (pages_SBK, binding.state.filled_positions()[:pages_SBK.shape[0]])
        own_pos = torch.arange(binding.position_offset, binding.position_offset + key_SBK.shape[0],
                               device=query_SBNK.device)
        if binding.mode == Mode.SWEEP:
            out = cp_sweep_sparse_latent_attention(query_SBNK, [pages, (key_SBK, own_pos)], topk_BSK,
                                                   self.softmax_scale, v_channels, binding.shard_sizes, group,
                                                   options=self.kernel_options)
        elif binding.mode == Mode.CAPTURE:
            mine, _ = chunk_query_positions(binding, group, query_SBNK.device)
            out = cp_sparse_latent_attention(
                torch.cat(all_gather_rows(query_SBNK, binding.shard_sizes, group)), [pages, (key_SBK, own_pos)],
                topk_BSK, self.softmax_scale, v_channels, group,
                options=self.kernel_options)[mine:mine + key_SBK.shape[0]]
        else:
            out = cp_sparse_latent_attention(query_SBNK, [pages], topk_BSK, self.softmax_scale,
                                             v_channels, group, own_keys_TBK=key_SBK, own_pos_T=own_pos,
                                             options=self.kernel_options)
        return up_project(out, up_v_weight)

    @torch.no_grad()
    def forward_decode(self, query_SBNK, latents: MLADecodeState, x, qr, up_v_weight, binding):
        """Decode: the newest tokens' attention over ``[shared prompt latents; the samples' own
        latents]`` (the new ones already appended to ``latents``); ``[s, b, heads * v]``.
        ``binding``: the MLA layer's. Under CP the prompt latents are this rank's shard and the
        partials merge over the group (``decode_sparse_attention``)."""
        _refuse_unsupported(self, "DSA", mode=Mode.DECODE)
        topk = self._topk(x, qr, lambda x, qr: self.indexer.topk_decode(x, qr))
        return decode_sparse_attention(query_SBNK, latents.prompt.filled(), latents.filled(), topk,
                                       up_v_weight, self.softmax_scale, self.config.kv_lora_rank,
                                       options=self.kernel_options,
                                       **_decode_shard(binding, latents, query_SBNK.shape[0]))


class LongStrawAbsorbedMLASelfAttention(AbsorbedMLASelfAttention, StatefulModule):
    """Megatron's ``AbsorbedMLASelfAttention`` with the MLA latent as LongStraw prompt state.

    Unbound: Megatron's forward. Bound (``longstraw.bind``): RoPE starts at the binding's
    ``position_offset``; ``Mode.CAPTURE`` attends the chunk over the latents captured so far plus
    itself and appends its latents; ``Mode.REPLAY`` attends the response over the prompt latents
    plus itself; ``Mode.DECODE`` appends each sample's new latents to its own and attends over the
    shared prompt latents plus its own; ``Mode.REFERENCE`` is the ordinary full-sequence forward with the prompt rows of
    the latent (``c_kv`` and ``k_rope``, the core attention's key) detached. The core attention
    must be ``LongStrawDSAttention``.

    ``--prompt-gradient exact`` (``core/state_grad.py``): exact ``Mode.REPLAY`` reads the prompt
    latents with gradients into their buffer (``grads.buffer("latent_SBD")``); ``Mode.SWEEP``
    attends the recomputed chunk over ``[latents before the chunk (read with gradients); its own
    latents]`` and injects the own latents' accumulated gradients. The latents are the whole MLA
    state (what ``Mode.REFERENCE`` detaches); no chunk-start state is needed.
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

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
                rotary_pos_cos_sin=None, attention_bias=None, packed_seq_params=None,
                position_ids=None, sequence_len_offset=None, *, inference_params=None):
        """Megatron's forward when unbound; the stateful forward when bound (see class doc)."""
        binding = self.longstraw
        if binding is None:
            return super().forward(
                hidden_states, attention_mask, key_value_states, inference_context, rotary_pos_emb,
                rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin, attention_bias, packed_seq_params,
                position_ids, sequence_len_offset, inference_params=inference_params)
        _refuse_unsupported(self, "MLA", packed_seq_params, inference_context or inference_params, binding.mode)
        if self.config.apply_rope_fusion or self.recompute_up_proj:
            raise ValueError("LongStraw MLA: --apply-rope-fusion and mla_up_proj recompute are not "
                             "supported in capture/replay")
        if not isinstance(self.core_attention, LongStrawDSAttention):
            raise TypeError("LongStraw MLA needs LongStrawDSAttention as core attention")
        mode, state = binding.mode, binding.state
        if mode not in (Mode.REFERENCE, Mode.SWEEP) and context_parallel_group() is None:  # CP: global
            done = state.length + (state.prompt.length if mode == Mode.DECODE else 0)
            if binding.position_offset != done:
                raise RuntimeError(f"LongStraw MLA: position offset {binding.position_offset} != "
                                   f"{done} tokens in the state")
        with self.rope_offset.shifted(binding.position_offset):
            q_absorbed, kv_latent, q_compressed = self.get_query_key_value_tensors(hidden_states)
        v_up_weight = self._get_v_up_weight()
        if mode == Mode.DECODE:  # sequence parallelism pads the tokens at the end: the first rows
            valid = binding.valid_length or q_absorbed.shape[0]
            state.append(kv_latent.squeeze(2)[:valid])
            core_out = pad_rows_to(self.core_attention.forward_decode(
                q_absorbed[:valid], state, hidden_states, q_compressed, v_up_weight, binding), q_absorbed.shape[0])
        elif mode == Mode.REFERENCE:
            core_out = self.core_attention(
                q_absorbed, detach_prefix(kv_latent, binding.prefix_length, 0), value=None,
                attention_mask=attention_mask, x=hidden_states, qr=q_compressed,
                up_v_weight=v_up_weight, position_ids=position_ids, attn_mask_type=self.attn_mask_type)
        elif mode == Mode.SWEEP:
            core_out = self._forward_sweep(q_absorbed, kv_latent, hidden_states, q_compressed, v_up_weight,
                                           binding)
        else:
            prefix_SBD = state.filled()
            if mode == Mode.REPLAY and binding.exact:  # gradients into the latents' buffer
                prefix_SBD = read_with_grad(prefix_SBD, state.grads.buffer("latent_SBD")[:state.length])
            core_out = self.core_attention.forward_after_prefix(
                q_absorbed, kv_latent, prefix_SBD, hidden_states, q_compressed, v_up_weight, binding)
            if mode == Mode.CAPTURE:  # not the sequence-parallel padding rows
                state.append(kv_latent.squeeze(2)[:binding.valid_length])
        core_out = _apply_absorbed_v_up_projection(
            core_out, v_up_weight, self.num_attention_heads_per_partition, self.config.kv_lora_rank,
            self.config.v_head_dim, getattr(self.core_attention, "consumes_absorbed_v_up_projection", False))
        return self.linear_proj(core_out)

    def _forward_sweep(self, q_absorbed, kv_latent, hidden_states, q_compressed, v_up_weight, binding):
        """The reverse sweep's recomputed chunk (``Mode.SWEEP``): its queries over the latents
        of the positions before it (their gradients go into the latents' buffer) and its own
        latents, which receive their rows' accumulated gradients; ``[s, b, heads * v]``. Under CP
        the chunk is this rank's shard and the latents before it are this rank's first
        ``binding.local_offset`` rows (the queries travel: ``cp_sweep_sparse_latent_attention``)."""
        start, valid = binding.position_offset, binding.valid_length or q_absorbed.shape[0]
        if binding.local_offset is not None:  # the rows of this rank's state before the chunk (CP)
            start = binding.local_offset
        state, grad_SBD = binding.state, binding.state.grads.buffer("latent_SBD")
        if start + valid > state.length:
            raise RuntimeError(f"LongStraw MLA: swept chunk [{start}, {start + valid}) beyond the "
                               f"{state.length} captured tokens")
        prefix_SBD = read_with_grad(state.latent_SBD[:start], grad_SBD[:start])
        core_out = self.core_attention.forward_after_prefix(
            q_absorbed, kv_latent, prefix_SBD, hidden_states, q_compressed, v_up_weight, binding)
        binding.sweep.inject(kv_latent.squeeze(2)[:valid], grad_SBD[start:start + valid])
        return core_out


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
