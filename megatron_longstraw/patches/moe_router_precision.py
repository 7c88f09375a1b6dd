"""Fix: the MoE router probabilities of an fp64 model stay fp64.

Megatron's ``topk_routing_with_score_function`` computes the softmax / sigmoid / sqrt-softplus
scores in fp32 and casts the probabilities back to the logits' dtype: with fp64 logits
(``moe_router_dtype="fp64"``, the fp64 models of GLM-5 and Qwen3.5-MoE) a round trip through
fp32. An fp64 model then rounds the router's gradient to fp32, differently for a sum over several
responses than for each response alone, so the fp64 tests of exact prompt gradients could not
resolve their bound (5e-8 on GLM-5's router weights, 1.2e-9 on Qwen3.5-MoE's). For fp64 logits
(unfused) the replacement keeps Megatron's selection (its routing map or top-k indices, expert
bias and groups included) and recomputes the selected experts' probabilities from the fp64
logits: a softmax over the selected logits (or, with ``use_pre_softmax``, the full softmax's
selected entries), the sigmoid / sqrt-softplus scores renormalized; then Megatron's scaling.
Everything else is Megatron's function, unchanged.
"""

import inspect

import torch
from megatron.core.transformer.moe import router

_ORIGINAL = router.topk_routing_with_score_function
_SIGNATURE = inspect.signature(_ORIGINAL)
_SCORE_FUNCTIONS = {"sigmoid": torch.sigmoid,
                    "sqrtsoftplus": lambda logits: torch.nn.functional.softplus(logits).sqrt()}
_SCORES = tuple(_SCORE_FUNCTIONS)


def topk_routing_with_score_function(*args, **kwargs):
    """Megatron's routing; for fp64 logits the probabilities of its selection in fp64."""
    call = _SIGNATURE.bind(*args, **kwargs)
    call.apply_defaults()
    options = call.arguments
    logits, score_function = options["logits"], options["score_function"]
    probs, selection = _ORIGINAL(*args, **kwargs)
    if logits.dtype != torch.float64 or options["fused"] or score_function not in _SCORES + ("softmax",):
        return probs, selection
    dense = options["dense_output"]  # selection: top-k indices [tokens, topk], else a routing map

    def pick(values, fill):
        return values.gather(1, selection) if dense else torch.where(selection, values, torch.full_like(values, fill))

    if score_function == "softmax":
        if options["use_pre_softmax"]:
            chosen = pick(torch.softmax(logits, dim=-1), 0.0)
        else:  # a softmax over the selected logits (unselected: exp(-inf) = 0)
            chosen = torch.softmax(pick(logits, float("-inf")), dim=-1)
    else:
        chosen = pick(_SCORE_FUNCTIONS[score_function](logits), 0.0)
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
