"""CPU patch: Megatron's Gated DeltaNet calls pure-torch kernels instead of fla's Triton ones.

``megatron.core.ssm.gated_delta_net`` imports fla's ``l2norm``, ``causal_conv1d`` and
``chunk_gated_delta_rule`` (fla imports on the CPU, but its Triton kernels need a GPU). This
patch rebinds those names in Megatron's GDN modules to ``megatron_longstraw.ops.gated_delta_torch``.
"""

from megatron.core.ssm.gated_delta_net import common as gdn_common
from megatron.core.ssm.gated_delta_net import gdn as gdn_module

from megatron_longstraw.ops import gated_delta_torch

import torch

_NAMES = ("l2norm", "causal_conv1d", "chunk_gated_delta_rule")
_ORIGINALS = {
    (mod.__name__, name): getattr(mod, name)
    for mod in (gdn_common, gdn_module)
    for name in _NAMES
    if hasattr(mod, name)
}


def needed() -> bool:
    """True when this process has no usable GPU."""
    return not torch.cuda.is_available()


def apply() -> None:
    """Rebind the fla kernel names in Megatron's GDN modules to the torch versions."""
    for mod in (gdn_common, gdn_module):
        for name in _NAMES:
            if hasattr(mod, name):
                setattr(mod, name, getattr(gated_delta_torch, name))


def revert() -> None:
    """Rebind the original fla kernels."""
    for mod in (gdn_common, gdn_module):
        for name in _NAMES:
            if (mod.__name__, name) in _ORIGINALS:
                setattr(mod, name, _ORIGINALS[(mod.__name__, name)])
