"""CPU patch: ``torch.cuda.synchronize()`` is a no-op when no GPU is present.

Megatron's checkpoint writer (``filesystem_async.preload_tensors``) synchronizes the GPU before
staging tensors; on a machine without a GPU that call raises, and there is nothing to wait for.
"""

import torch

_ORIGINAL = torch.cuda.synchronize


def _no_sync(device=None):
    return None


def needed() -> bool:
    """True when this process has no usable GPU."""
    return not torch.cuda.is_available()


def apply() -> None:
    """Make ``torch.cuda.synchronize`` a no-op."""
    torch.cuda.synchronize = _no_sync


def revert() -> None:
    """Restore the original ``torch.cuda.synchronize``."""
    torch.cuda.synchronize = _ORIGINAL
