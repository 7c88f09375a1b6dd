"""The pieces of a ``GPTModel`` forward, called with explicit positions.

Capture and replay run the model on a slice of the sequence (a prompt chunk, or response tokens
after the prompt), so positions start at an offset; Megatron's ``GPTModel.forward`` always starts
RoPE at 0. These helpers call Megatron's own embedding, rotary table, decoder and output layer.
"""

import torch
from megatron.core import parallel_state, tensor_parallel


def embed(model, input_ids_BS: torch.Tensor, offset: int) -> torch.Tensor:
    """Token embeddings ``[s, b, h]`` of tokens at positions ``offset...``."""
    seq = input_ids_BS.shape[1]
    position_ids = torch.arange(offset, offset + seq, device=input_ids_BS.device).expand_as(input_ids_BS)
    return model.embedding(input_ids=input_ids_BS, position_ids=position_ids)


def decode(model, hidden_SBH: torch.Tensor, offset: int) -> torch.Tensor:
    """Run the decoder (ending with its final norm) on ``hidden`` at positions ``offset...``.

    Models whose attention computes its own RoPE (MLA) read the offset from their binding.
    Under context parallelism the caller feeds this rank's own tokens at their own positions,
    so Megatron's CP slicing of the rotary table is turned off (``packed_seq=True`` does only
    that in ``RotaryEmbedding.forward``).
    """
    rotary = None
    if getattr(model, "rotary_pos_emb", None) is not None:
        cp = parallel_state.get_context_parallel_world_size() > 1
        rotary = model.rotary_pos_emb(hidden_SBH.shape[0], offset=offset, packed_seq=cp)
    return model.decoder(hidden_states=hidden_SBH, attention_mask=None, rotary_pos_emb=rotary)


def output_logits(model, hidden_SBH: torch.Tensor) -> torch.Tensor:
    """Logits ``[s, b, vocab / tp]`` (this rank's vocabulary shard)."""
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    return model.output_layer(hidden_SBH, weight=weight)[0]


def token_logprobs(logits_SBV: torch.Tensor, targets_SB: torch.Tensor) -> torch.Tensor:
    """``log p(target)`` per position, ``[s, b]`` in fp32 (Megatron's cross entropy computes in
    fp32 whatever the input), over the TP-sharded vocabulary."""
    # Megatron's cross entropy subtracts the max in place: hand it a copy, never the caller's
    # logits (for fp32 logits its ``.float()`` is the tensor itself, often a custom Function's view).
    logits_SBV = logits_SBV.to(torch.float32, copy=True)
    return -tensor_parallel.vocab_parallel_cross_entropy(logits_SBV, targets_SB.contiguous())


def token_entropy(logits_SBV: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution per position, ``[s, b]`` in fp32, over the
    TP-sharded vocabulary (partial sums all-reduced with gradients, as Megatron's cross entropy)."""
    logits_SBV = logits_SBV.float()
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
    """Forward pre-hook on the decoder's final norm: keeps its input, or detaches a prefix of it."""

    def __init__(self, model, detach_rows: int = 0):
        self.detach_rows = detach_rows
        self.last_row_1BH = None
        self._handle = model.decoder.final_layernorm.register_forward_pre_hook(self)

    def __call__(self, module, args):
        hidden = args[0]
        self.last_row_1BH = hidden[-1:].detach()
        if self.detach_rows:
            head, tail = hidden[: self.detach_rows], hidden[self.detach_rows:]
            return (torch.cat([head.detach(), tail]),) + tuple(args[1:])
        return None

    def remove(self) -> None:
        """Unregister the hook."""
        self._handle.remove()
