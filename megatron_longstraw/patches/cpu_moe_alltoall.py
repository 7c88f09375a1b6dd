"""CPU patch: Megatron's all-to-all MoE token dispatcher runs without CUDA streams.

``MoEAlltoAllTokenDispatcher.__init__`` creates a ``torch.cuda.Stream()`` (class attribute
``cuda_dtoh_stream``) and ``_maybe_dtoh_and_synchronize`` copies the routing metadata
(``tokens_per_expert``, the all-to-all split sizes) device-to-host on that stream, then waits
on a CUDA event. On the CPU that metadata already lives on the host, so the CPU version of the
method does only what the original does to the host copies: at the same ``cuda_dtoh_point`` it
turns the split sizes into numpy arrays (``all_to_all_single`` wants sequences, not tensors); the
class gets a placeholder stream so that no CUDA stream is created. Needed for expert parallelism over gloo (EP > 1 on CPU).
"""

import torch
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

_ORIGINAL_METHOD = MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize
_ORIGINAL_STREAM = MoEAlltoAllTokenDispatcher.cuda_dtoh_stream


class _NoStream:
    """Placeholder for ``cuda_dtoh_stream`` on the CPU; never used as a stream."""


def _cpu_maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
    """Host-only twin of the original: split sizes -> numpy at the dtoh point, no streams."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name, None)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def needed() -> bool:
    """True when this process has no usable GPU."""
    return not torch.cuda.is_available()


def apply() -> None:
    """Install the stream placeholder and the host-only metadata step."""
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NoStream()
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _cpu_maybe_dtoh_and_synchronize


def revert() -> None:
    """Restore Megatron's CUDA-stream version."""
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _ORIGINAL_STREAM
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _ORIGINAL_METHOD
