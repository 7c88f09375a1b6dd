"""CPU patch: ``Tensor.cuda()`` returns the tensor itself when there is no GPU.

Megatron moves tensors with ``.cuda()`` in a few set-up paths, e.g. ``LanguageModule.
setup_embeddings_and_output_layer`` all-reduces the tied embedding between the first and last
pipeline stage after ``weight.data.cuda()``. Without a GPU that raises; with this patch the
tensor stays where it is (the CPU), as every other CPU-compat patch keeps work on the CPU.
"""

import torch

_ORIGINAL = torch.Tensor.cuda


def _stay(self, *args, **kwargs):
    return self


def needed() -> bool:
    """True when this process has no usable GPU."""
    return not torch.cuda.is_available()


def apply() -> None:
    """Make ``Tensor.cuda`` the identity."""
    torch.Tensor.cuda = _stay


def revert() -> None:
    """Restore ``Tensor.cuda``."""
    torch.Tensor.cuda = _ORIGINAL
