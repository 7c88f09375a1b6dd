"""Fix: the MoE router probabilities of an fp64 model stay fp64.

Megatron's ``topk_routing_with_score_function`` computes the sigmoid / sqrt-softplus scores as
``f(logits.float())`` and casts the probabilities back to the logits' dtype: with fp64 logits
(``moe_router_dtype="fp64"``, GLM-5's fp64 models) a round trip through fp32. An fp64 model then
rounds the router's gradient to fp32, differently for a sum over several responses than for each
response alone, so the fp64 tests of exact prompt gradients could not resolve their bound (5e-8
on the router weights). For fp64 logits with those score functions (unfused) the replacement
keeps Megatron's selection (its routing map or top-k indices, expert bias and groups included)
and recomputes the selected experts' probabilities from the fp64 scores, with Megatron's
normalization and scaling; everything else is Megatron's function, unchanged.
"""

import inspect

import torch
from megatron.core.transformer.moe import router

_ORIGINAL = router.topk_routing_with_score_function
_SIGNATURE = inspect.signature(_ORIGINAL)
_SCORES = {"sigmoid": torch.sigmoid,
           "sqrtsoftplus": lambda logits: torch.nn.functional.softplus(logits).sqrt()}


def topk_routing_with_score_function(*args, **kwargs):
    """Megatron's routing; for fp64 logits with a sigmoid / sqrt-softplus score function the
    probabilities of its selection in fp64."""
    call = _SIGNATURE.bind(*args, **kwargs)
    call.apply_defaults()
    options = call.arguments
    logits, score_function = options["logits"], options["score_function"]
    probs, selection = _ORIGINAL(*args, **kwargs)
    if logits.dtype != torch.float64 or score_function not in _SCORES or options["fused"]:
        return probs, selection
    scores = _SCORES[score_function](logits)
    if options["dense_output"]:  # selection: the top-k indices [tokens, topk]
        chosen = scores.gather(1, selection)
    else:  # selection: the routing map [tokens, experts]
        chosen = torch.where(selection, scores, torch.zeros_like(scores))
    if options["topk"] > 1:
        chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20)
    if options["scaling_factor"]:
        chosen = chosen * options["scaling_factor"]
    return chosen, selection


def needed() -> bool:
    """Always (a no-op below fp64)."""
    return True


def apply() -> None:
    """Install the fp64-keeping routing."""
    router.topk_routing_with_score_function = topk_routing_with_score_function


def revert() -> None:
    """Restore Megatron's routing."""
    router.topk_routing_with_score_function = _ORIGINAL
