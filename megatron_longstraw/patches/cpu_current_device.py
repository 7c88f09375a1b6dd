"""CPU patch: ``torch.cuda.current_device()`` answers ``cpu`` when no GPU is present.

Megatron modules (``DotProductAttention``, ``GatedDeltaNet``, the MoE router and token
dispatcher, HybridStack) allocate buffers and parameters with
``device=torch.cuda.current_device()``. On a machine without a GPU that call raises; with this
patch it returns the CPU device, so the same modules build and run on the CPU. The patch is
applied only when CUDA is unavailable and is a no-op on a GPU host.
"""

import torch

_ORIGINAL = torch.cuda.current_device


def _cpu_current_device():
    return torch.device("cpu")


def needed() -> bool:
    """True when this process has no usable GPU."""
    return not torch.cuda.is_available()


def apply() -> None:
    """Point ``torch.cuda.current_device`` at the CPU."""
    torch.cuda.current_device = _cpu_current_device


def revert() -> None:
    """Restore the original ``torch.cuda.current_device``."""
    torch.cuda.current_device = _ORIGINAL
