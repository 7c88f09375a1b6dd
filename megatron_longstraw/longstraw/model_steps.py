"""The pieces of a ``GPTModel`` forward, called with explicit positions.

Capture and replay run the model on a slice of the sequence (a prompt chunk, or response tokens
after the prompt), so positions start at an offset; Megatron's ``GPTModel.forward`` always starts
RoPE at 0. These helpers call Megatron's own embedding, rotary table, decoder and output layer.
"""

import contextlib

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig


def sequence_parallel(model) -> bool:
    """Whether ``model`` runs Megatron's sequence parallelism (TP > 1 and ``sequence_parallel``)."""
    return bool(model.config.sequence_parallel) and parallel_state.get_tensor_model_parallel_world_size() > 1


@contextlib.contextmanager
def without_activation_recompute(model):
    """Megatron's activation recomputation (``--recompute-granularity``) off for the block.

    The reverse sweep of ``--prompt-gradient exact`` injects gradients into tensors a chunk's
    forward makes inside each layer (its K/V pages, a recurrent layer's state); a checkpointed
    layer runs that forward without autograd and recomputes it only inside its own backward, where
    nothing injected reaches it. The sweep therefore keeps one chunk's activations whole (the
    memory floor counts them)."""
    configs = {id(m.config): m.config for m in model.modules()
               if isinstance(getattr(m, "config", None), TransformerConfig)}
    previous = {key: config.recompute_granularity for key, config in configs.items()}
    for config in configs.values():
        config.recompute_granularity = None
    try:
        yield
    finally:
        for key, config in configs.items():
            config.recompute_granularity = previous[key]


def _pad_rows(tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``tensor`` right-padded with zeros along ``dim`` to a multiple of the TP size."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pad = -tensor.shape[dim] % tp
    if pad == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = pad
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


def _on_sequence_shards(model, fn, full_SBH: torch.Tensor, gather: bool = True) -> torch.Tensor:
    """Under sequence parallelism, ``fn`` applied to this rank's shard of ``full_SBH`` (replicated
    over TP, rows padded at the end to a multiple of TP); the full result, padding removed.

    The interface tensors of these model steps are the whole sequence on every TP rank: a slice's
    rows (its last one, the prompt boundary) are then where the caller expects them. The scatter's
    backward gathers and the gather's backward splits, so gradients stay exact as long as what the
    caller computes from the full tensors is replicated over TP (it is: Megatron's vocab-parallel
    loss all-reduces). ``gather=False``: ``fn``'s output is not sequence-sharded (output layer).
    """
    seq = full_SBH.shape[0]
    shard = tensor_parallel.scatter_to_sequence_parallel_region(_pad_rows(full_SBH))
    out = fn(shard)
    if gather:
        out = tensor_parallel.gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
    return out[:seq]


def embed(model, input_ids_BS: torch.Tensor, offset: int) -> torch.Tensor:
    """Token embeddings ``[s, b, h]`` of tokens at positions ``offset...`` (the whole slice on
    every TP rank, also under sequence parallelism)."""
    seq = input_ids_BS.shape[1]
    if sequence_parallel(model):
        ids_BS = _pad_rows(input_ids_BS, dim=1)
        position_ids = torch.arange(offset, offset + ids_BS.shape[1], device=ids_BS.device).expand_as(ids_BS)
        shard = model.embedding(input_ids=ids_BS, position_ids=position_ids)
        return tensor_parallel.gather_from_sequence_parallel_region(shard, tensor_parallel_output_grad=False)[:seq]
    position_ids = torch.arange(offset, offset + seq, device=input_ids_BS.device).expand_as(input_ids_BS)
    return model.embedding(input_ids=input_ids_BS, position_ids=position_ids)


def decode(model, hidden_SBH: torch.Tensor, offset: int) -> torch.Tensor:
    """Run the decoder (ending with its final norm) on ``hidden`` at positions ``offset...``.

    Models whose attention computes its own RoPE (MLA) read the offset from their binding.
    Under context parallelism the caller feeds this rank's own tokens at their own positions,
    so Megatron's CP slicing of the rotary table is turned off (``packed_seq=True`` does only
    that in ``RotaryEmbedding.forward``).

    Under sequence parallelism ``hidden`` and the result are the whole slice on every TP rank;
    the decoder runs on this rank's shard of it, padded at the end to a multiple of TP (stateful
    layers capture only the bound ``valid_length`` rows; padding after the real tokens does not
    change their outputs, attention being causal).
    """
    rotary = None
    seq = hidden_SBH.shape[0]
    sp = sequence_parallel(model)
    if sp:
        seq += -seq % parallel_state.get_tensor_model_parallel_world_size()
    if getattr(model, "rotary_pos_emb", None) is not None:
        cp = parallel_state.get_context_parallel_world_size() > 1
        rotary = model.rotary_pos_emb(seq, offset=offset, packed_seq=cp)

    def run(h):
        if not model.decoder.pre_process:  # a later pipeline stage's block reads its input_tensor
            model.decoder.set_input_tensor(h)  # (under SP: this rank's shard, not the whole slice)
        return model.decoder(hidden_states=h, attention_mask=None, rotary_pos_emb=rotary)
    return _on_sequence_shards(model, run, hidden_SBH) if sp else run(hidden_SBH)


def final_norm(model, hidden_SBH: torch.Tensor) -> torch.Tensor:
    """The decoder's final norm on ``hidden`` (whole rows on every TP rank); under sequence
    parallelism on sequence shards, so its weight gradient is not counted once per TP rank by
    Megatron's sequence-parallel gradient all-reduce."""
    norm = model.decoder.final_layernorm
    return _on_sequence_shards(model, norm, hidden_SBH) if sequence_parallel(model) else norm(hidden_SBH)


def predicting_hidden(model, last_hidden_1BH: torch.Tensor, hidden_SBH: torch.Tensor) -> torch.Tensor:
    """Final hidden states ``[r, b, h]`` predicting each of ``r`` response tokens from the
    decoder's output ``hidden_SBH`` at the response's own positions: row 0 from the prompt's last
    position (its final-norm input ``last_hidden_1BH``, normed here, with grad for the norm),
    rows 1.. from the response's first ``r - 1`` positions."""
    first_1BH = final_norm(model, last_hidden_1BH.expand(-1, hidden_SBH.shape[1], -1))
    return torch.cat([first_1BH, hidden_SBH[:-1]])


def output_logits(model, hidden_SBH: torch.Tensor) -> torch.Tensor:
    """Logits ``[s, b, vocab / tp]`` (this rank's vocabulary shard)."""
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    run = lambda h: model.output_layer(h, weight=weight)[0]
    if sequence_parallel(model):  # Megatron's output layer gathers the sequence shards itself
        return _on_sequence_shards(model, run, hidden_SBH, gather=False)
    return run(hidden_SBH)


def token_logprobs(logits_SBV: torch.Tensor, targets_SB: torch.Tensor) -> torch.Tensor:
    """``log p(target)`` per position, ``[s, b]`` in fp32 (fp64 for fp64 logits:
    ``patches.cross_entropy_precision``), over the TP-sharded vocabulary."""
    # Megatron's cross entropy subtracts the max in place: hand it a copy, never the caller's
    # logits (for fp32 logits its ``.float()`` is the tensor itself, often a custom Function's view).
    logits_SBV = logits_SBV.to(torch.promote_types(logits_SBV.dtype, torch.float32), copy=True)
    return -tensor_parallel.vocab_parallel_cross_entropy(logits_SBV, targets_SB.contiguous())


def token_entropy(logits_SBV: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution per position, ``[s, b]`` in fp32 (fp64 for fp64
    logits), over the TP-sharded vocabulary (partial sums all-reduced with gradients, as
    Megatron's cross entropy)."""
    logits_SBV = logits_SBV.to(torch.promote_types(logits_SBV.dtype, torch.float32))
    max_SB1 = logits_SBV.detach().max(dim=-1, keepdim=True).values
    torch.distributed.all_reduce(max_SB1, op=torch.distributed.ReduceOp.MAX,
                                 group=parallel_state.get_tensor_model_parallel_group())
    shifted_SBV = logits_SBV - max_SB1
    exp_SBV = shifted_SBV.exp()
    sum_exp_SB = tensor_parallel.reduce_from_tensor_model_parallel_region(exp_SBV.sum(-1))
    weighted_SB = tensor_parallel.reduce_from_tensor_model_parallel_region((exp_SBV * shifted_SBV).sum(-1))
    return sum_exp_SB.log() - weighted_SB / sum_exp_SB


def _chunk_logprobs(model, hidden_SBH, targets_SB, with_entropy=False):
    logits_SBV = output_logits(model, hidden_SBH)
    logprobs_SB = token_logprobs(logits_SBV, targets_SB)
    return (logprobs_SB, token_entropy(logits_SBV)) if with_entropy else logprobs_SB


def response_logprobs(model, hidden_SBH: torch.Tensor, targets_SB: torch.Tensor,
                      chunk_tokens: int = 512, with_entropy: bool = False):
    """``log p(target)`` ``[s, b]`` from final hidden states, ``chunk_tokens`` positions at a time
    (with ``with_entropy``: also the entropy ``[s, b]`` of each position's distribution).

    With autograd, each chunk's logits are recomputed in backward (activation checkpoint), so a
    response keeps only its hidden states, not ``s x vocab`` logits and softmax (8K tokens of a
    248K vocabulary would be ~12 GB). A 512-token chunk's transient logits, fp32 copy and
    softmax gradient at a 248K vocabulary are ~1.5 GB.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    pieces = []
    for start in range(0, hidden_SBH.shape[0], chunk_tokens):
        hidden, targets = hidden_SBH[start:start + chunk_tokens], targets_SB[start:start + chunk_tokens]
        if torch.is_grad_enabled() and hidden.requires_grad:
            pieces.append(torch.utils.checkpoint.checkpoint(
                _chunk_logprobs, model, hidden, targets, with_entropy, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(model, hidden, targets, with_entropy))
    if with_entropy:
        return torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
    return torch.cat(pieces)


def loss_of(loss_fn, model, hidden_SBH, ids_BR, mask_RB, indices) -> torch.Tensor:
    """Call ``loss_fn`` on a micro-batch's log-probs (and entropies when the loss asks for
    them with a true ``needs_entropy`` attribute)."""
    if getattr(loss_fn, "needs_entropy", False):
        logprobs_RB, entropy_RB = response_logprobs(model, hidden_SBH, ids_BR.t(), with_entropy=True)
        return loss_fn(logprobs_RB, mask_RB, indices, entropy_RB=entropy_RB)
    return loss_fn(response_logprobs(model, hidden_SBH, ids_BR.t()), mask_RB, indices)


class FinalNormInput:
    """Forward pre-hook on the decoder's final norm: keeps its input (detached, or with its graph
    for the reverse sweep: ``keep_graph``), or detaches a prefix of it.

    Under sequence parallelism the norm sees this rank's sequence shard: the kept input
    (``input_SBH``) is gathered (with ``decode``'s padding rows at the end) and ``detach_rows``
    counts rows of the whole sequence.
    """

    def __init__(self, model, detach_rows: int = 0, keep_graph: bool = False):
        self.detach_rows, self.keep_graph = detach_rows, keep_graph
        self.input_SBH = None
        self._sp = sequence_parallel(model)
        self._handle = model.decoder.final_layernorm.register_forward_pre_hook(self)

    def last_row_1BH(self, length: int) -> torch.Tensor:
        """The kept input's row of the last real token of a ``length``-token slice (under
        sequence parallelism the kept input ends in ``decode``'s padding rows)."""
        return self.input_SBH[length - 1:length]

    def __call__(self, module, args):
        hidden = args[0]
        detach_rows = self.detach_rows
        if self._sp and self.keep_graph:  # the gather's backward hands each rank its own rows' gradient
            self.input_SBH = tensor_parallel.gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False)
        elif self._sp:
            with torch.no_grad():
                self.input_SBH = tensor_parallel.gather_from_sequence_parallel_region(
                    hidden.detach(), tensor_parallel_output_grad=False)
            start = parallel_state.get_tensor_model_parallel_rank() * hidden.shape[0]
            detach_rows = min(max(detach_rows - start, 0), hidden.shape[0])
        else:
            self.input_SBH = hidden if self.keep_graph else hidden.detach()
        if detach_rows:
            head, tail = hidden[:detach_rows], hidden[detach_rows:]
            return (torch.cat([head.detach(), tail]),) + tuple(args[1:])
        return None

    def remove(self) -> None:
        """Unregister the hook."""
        self._handle.remove()
