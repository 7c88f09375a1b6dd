"""Analytic FLOPs (for MFU) and the memory floor of a LongStraw step.

The FLOPs formulas belong to the model families (``prompt_flops`` / ``response_forward_flops`` of
each family's ``models/<family>/profile.py``, composed from ``models/flops.py``); this module asks
the model's family.
"""

from megatron_longstraw.models.registry import family_for


def prompt_flops(hf: dict, model, prompt_length: int) -> float | None:
    """Forward FLOPs of capturing a ``prompt_length`` prompt (``None`` for a family without a
    formula)."""
    family = family_for(hf["model_type"])
    return family.prompt_flops(family.normalize_hf_config(hf), model, prompt_length)


def response_forward_flops(hf: dict, model, prompt_length: int, response_tokens: int) -> float | None:
    """Forward FLOPs of one response of ``response_tokens`` tokens after a ``prompt_length``
    prompt (``None`` for a family without a formula)."""
    family = family_for(hf["model_type"])
    return family.response_forward_flops(family.normalize_hf_config(hf), model, prompt_length, response_tokens)


def memory_floor_bytes(n_params: int, param_bytes: int, optimizer_bytes_per_param: int,
                       prompt_state_bytes: int, response_activation_bytes: int) -> int:
    """Parameters + gradients + optimizer states + prompt state + one response's activations."""
    return (n_params * (2 * param_bytes + optimizer_bytes_per_param)
            + prompt_state_bytes + response_activation_bytes)
