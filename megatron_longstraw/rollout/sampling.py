"""Next-token sampling: temperature scaling, top-p (nucleus) filtering, greedy or random draws.

Pure functions on full-vocabulary logits ``[b, vocab]``. Order: temperature first, then top-p on
the tempered distribution, then a draw (HF ``generate``'s order). Temperature 0 means greedy
(argmax, ties to the lowest token id); top-p 1 keeps every token. ``TokenDistribution`` does a
decoding step's draw and both log-probabilities from one pass over the logits.
"""

from typing import Optional

import torch


def check_sampling(temperature: float, top_p: float) -> None:
    """``ValueError`` naming the flag for a temperature < 0 or a top-p outside (0, 1]."""
    if not temperature >= 0:  # also NaN
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {top_p}")


def scale_logits(logits_BV: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 ``logits / temperature`` (``temperature > 0``)."""
    assert temperature > 0, temperature
    return logits_BV.float() / temperature


def top_p_filter(logits_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logits`` with every token outside the nucleus set to ``-inf``.

    The nucleus is the smallest set of most probable tokens whose probability mass is
    ``>= top_p``: sorted by probability (equal probabilities by token id, lower first), a token is
    kept while the mass of the tokens before it is ``< top_p``. The most probable token is always
    kept; ``top_p == 1`` keeps everything (no rounding can drop a token).
    """
    if top_p >= 1:
        return logits_BV
    probs_BV = logits_BV.float().softmax(dim=-1)
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True, stable=True)
    mass_before_BV = sorted_BV.cumsum(dim=-1) - sorted_BV
    keep_sorted_BV = mass_before_BV < top_p
    keep_sorted_BV[:, 0] = True
    keep_BV = torch.zeros_like(keep_sorted_BV).scatter(-1, order_BV, keep_sorted_BV)
    return logits_BV.masked_fill(~keep_BV, float("-inf"))


def sampling_probs(logits_BV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution ``[b, vocab]`` (fp32) a token is drawn from at ``temperature > 0``."""
    return top_p_filter(scale_logits(logits_BV, temperature), top_p).softmax(dim=-1)


def sample_tokens(logits_BV: torch.Tensor, temperature: float, top_p: float,
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token id per row, ``[b]`` int64 on the logits' device.

    Greedy (argmax, lowest id on ties) when ``temperature == 0``; otherwise one draw per row from
    ``sampling_probs`` with ``generator`` (drawn on the generator's device: the same seed gives
    the same tokens for the same logits).
    """
    check_sampling(temperature, top_p)
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    probs_BV = sampling_probs(logits_BV, temperature, top_p)
    device = generator.device if generator is not None else probs_BV.device
    tokens_B1 = torch.multinomial(probs_BV.to(device), 1, generator=generator)
    return tokens_B1[:, 0].to(logits_BV.device)


def token_logprobs_full_vocab(logits_BV: torch.Tensor, tokens_B: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[token]`` per row in fp32: the model's own log-probability (temperature
    1, no top-p), what replay computes for the same token."""
    return logits_BV.float().log_softmax(dim=-1).gather(-1, tokens_B[:, None])[:, 0]


def sampling_logprobs(logits_BV: torch.Tensor, tokens_B: torch.Tensor, temperature: float,
                      top_p: float) -> torch.Tensor:
    """``log q(token)`` per row under the distribution ``sample_tokens`` draws from (fp32): the
    tempered, top-p-filtered softmax; 0 when greedy (the argmax has probability 1)."""
    if temperature == 0:
        return torch.zeros(tokens_B.shape, dtype=torch.float32, device=logits_BV.device)
    filtered_BV = top_p_filter(scale_logits(logits_BV, temperature), top_p)
    return filtered_BV.log_softmax(dim=-1).gather(-1, tokens_B[:, None])[:, 0]


def log_softmax_rows(logits_BV: torch.Tensor) -> torch.Tensor:
    """fp32 ``log softmax`` over the vocabulary as ``logits - logsumexp(logits)``. torch's softmax
    kernels give each row one thread block, so G rows of a 248K vocabulary keep G
    multiprocessors busy (~60 us a call on an H200); its reductions split a long row over many."""
    logits_BV = logits_BV.float()
    return logits_BV - torch.logsumexp(logits_BV, dim=-1, keepdim=True)


class TokenDistribution:
    """One decoding step's next-token distributions ``[b, vocab]``: what ``sample_tokens`` draws
    from, and both log-probabilities of a drawn token (``token_logprobs_full_vocab``'s and
    ``sampling_logprobs``'), from one log-sum-exp of the logits (two where temperature or top-p
    change the distribution)."""

    def __init__(self, logits_BV: torch.Tensor, temperature: float, top_p: float):
        check_sampling(temperature, top_p)
        self.logits_BV = logits_BV.float()
        self.model_lse_B1 = torch.logsumexp(self.logits_BV, dim=-1, keepdim=True)
        self.sampling_logq_BV = None  # log q over the vocabulary (None when greedy)
        if temperature > 0 and (temperature != 1 or top_p < 1):
            self.sampling_logq_BV = log_softmax_rows(top_p_filter(scale_logits(self.logits_BV, temperature), top_p))
        elif temperature > 0:  # the model's own distribution
            self.sampling_logq_BV = self.logits_BV - self.model_lse_B1

    def draw(self, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """One token id per row (``[b]`` int64 on the logits' device): the argmax (lowest id on
        ties) when greedy, else a draw with ``generator`` (on the generator's device)."""
        if self.sampling_logq_BV is None:
            return self.logits_BV.argmax(dim=-1)
        probs_BV = self.sampling_logq_BV.exp()
        device = generator.device if generator is not None else probs_BV.device
        return torch.multinomial(probs_BV.to(device), 1, generator=generator)[:, 0].to(self.logits_BV.device)

    def scores(self, tokens_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log p(token), log q(token))`` per row, fp32: the model's (temperature 1, no top-p)
        and the sampling distribution's (0 when greedy)."""
        index_B1 = tokens_B[:, None]
        model_B = (self.logits_BV.gather(-1, index_B1) - self.model_lse_B1)[:, 0]
        if self.sampling_logq_BV is None:
            return model_B, torch.zeros_like(model_B)
        return model_B, self.sampling_logq_BV.gather(-1, index_B1)[:, 0]
