"""Count the bytes autograd keeps for backward: the activation term of the memory floor."""

from typing import Iterable

import torch


class SavedTensorMeter:
    """Context manager summing the distinct storages saved for backward inside the block.

    Storages of ``exclude`` (parameters, the prompt state: already counted elsewhere) are not
    counted; a storage saved several times counts once.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude if t is not None}
        self._bytes: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @torch.compiler.disable  # a hook, not model code: compiled callers would retrace it per storage
    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._excluded:
            self._bytes[storage.data_ptr()] = storage.nbytes()
        return tensor.detach()  # not the tensor itself: a saved output would hold its own graph node

    @property
    def nbytes(self) -> int:
        """Bytes counted so far."""
        return sum(self._bytes.values())

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)
