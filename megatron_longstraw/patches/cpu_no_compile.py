"""CPU patch: run Megatron's ``jit_fuser`` (``torch.compile``) functions eagerly.

Megatron decorates small fused helpers (GDN input preparation, gated norms, bias-GeLU, ...)
with ``torch.compile``. On a 2-core CPU machine Inductor's C++ compilation costs minutes per
test run and adds nothing to correctness, so on CPU dynamo is disabled.
"""

import torch
import torch._dynamo

_ORIGINAL = torch._dynamo.config.disable


def needed() -> bool:
    """True when this process has no usable GPU."""
    return not torch.cuda.is_available()


def apply() -> None:
    """Disable dynamo so compiled functions run as plain Python."""
    torch._dynamo.config.disable = True


def revert() -> None:
    """Restore dynamo's setting."""
    torch._dynamo.config.disable = _ORIGINAL
