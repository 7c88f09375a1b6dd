"""How the attention modules receive the kernels' options (``config/kernels.py``'s ``KernelOptions``).

One ``KernelOptions`` reaches the kernels as an argument: ``models/builder.py`` hands the
model's ``ModelOptions.kernel_options`` to every module that ``UsesKernelOptions``
(``set_kernel_options``), which passes it down to its kernels. Nothing is read from the
environment.
"""

from typing import TYPE_CHECKING

from megatron_longstraw.config.kernels import KernelOptions

if TYPE_CHECKING:
    import torch

MAX_DECODE_SPLITS = 256
"""At most this many splits of the pages per decode attention call (``decode_split_keys``)."""


class UsesKernelOptions:
    """A module whose attention kernels take ``KernelOptions``: it passes ``kernel_options`` (the
    defaults until ``set_kernel_options``) to them."""

    kernel_options: KernelOptions = KernelOptions()


def set_kernel_options(model: "torch.nn.Module", options: KernelOptions) -> None:
    """Hand ``options`` to every module of ``model`` that ``UsesKernelOptions``."""
    for module in model.modules():
        if isinstance(module, UsesKernelOptions):
            module.kernel_options = options
