"""Fix: sum Gated DeltaNet output-norm gradients over tensor-parallel ranks.

GDN's ``out_norm`` normalizes each value head with one weight shared by all heads. Under TP
each rank holds different heads, so each rank's gradient of that shared weight is partial.
Megatron's ``_allreduce_non_tensor_model_parallel_grads`` sums such partial gradients for
``q_layernorm``/``k_layernorm`` and for sequence-parallel norms, but not for GDN's
``out_norm`` without sequence parallelism, so TP ranks would drift apart. This patch wraps that
function to also sum ``*.out_norm.weight`` gradients over the TP group in that case.
"""

import importlib

import torch
from megatron.core import parallel_state
from megatron.core.utils import get_attr_wrapped_model

# the package re-exports a function of the same name, so import the module by path
finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
_ORIGINAL = finalize._allreduce_non_tensor_model_parallel_grads


def _with_gdn_out_norm(model, config, tp_group=None):
    _ORIGINAL(model, config, tp_group)
    tp_group = tp_group or parallel_state.get_tensor_model_parallel_group()
    if tp_group.size() <= 1:
        return
    grads = []
    for chunk in model:
        for name, param in get_attr_wrapped_model(chunk, "named_parameters")():
            if not name.endswith(".out_norm.weight") or not param.requires_grad:
                continue
            if config.sequence_parallel and getattr(param, "sequence_parallel", False):
                continue  # already summed by Megatron's sequence-parallel path
            grad = getattr(param, finalize._get_main_grad_attr(param))
            if grad is not None:
                grads.append(grad)
    for grad in grads:
        torch.distributed.all_reduce(grad, group=tp_group)


def needed() -> bool:
    """Always: the gap exists on CPU and GPU alike."""
    return True


def apply() -> None:
    """Wrap Megatron's non-TP gradient all-reduce."""
    finalize._allreduce_non_tensor_model_parallel_grads = _with_gdn_out_norm


def revert() -> None:
    """Restore Megatron's function."""
    finalize._allreduce_non_tensor_model_parallel_grads = _ORIGINAL
