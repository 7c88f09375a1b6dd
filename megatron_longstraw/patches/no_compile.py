"""Patch: run Megatron's ``jit_fuser`` (``torch.compile``) functions eagerly, on CPU or when
``LONGSTRAW_NO_COMPILE=1``.

Megatron decorates small fused helpers (GDN input preparation, gated norms, bias-GeLU, ...)
with ``torch.compile``. On a 2-core CPU machine Inductor's C++ compilation costs minutes per
test run and adds nothing to correctness, so on CPU dynamo is disabled. On a GPU each new
process compiles them again for every new shape (about a minute per process in the GPU test
tier, where every parity test spawns fresh ranks and runs many small shapes); the GPU test
runner sets ``LONGSTRAW_NO_COMPILE=1``, the benchmarks and training keep the compiled fusions.
"""

import os

import torch
import torch._dynamo

_ORIGINAL = torch._dynamo.config.disable


def needed() -> bool:
    """True when this process has no usable GPU, or ``LONGSTRAW_NO_COMPILE=1`` asks for eager."""
    return not torch.cuda.is_available() or os.environ.get("LONGSTRAW_NO_COMPILE") == "1"


def apply() -> None:
    """Disable dynamo so compiled functions run as plain Python."""
    torch._dynamo.config.disable = True


def revert() -> None:
    """Restore dynamo's setting."""
    torch._dynamo.config.disable = _ORIGINAL
