"""CPU patch: Megatron's pipeline schedules and their point-to-point communication on gloo.

``megatron.core.pipeline_parallel.schedules`` allocates its token counter with a literal
``device="cuda"``, and ``p2p_communication`` builds its receive buffers the same way. Given the
CPU ``torch`` of ``cpu_optimizer_device`` (tensor factories map ``device='cuda'`` to the CPU,
everything else is the real ``torch``), ``get_forward_backward_func()``'s schedules run over gloo,
so pipeline-parallel capture/replay is tested on CPU (``tests/test_pipeline_parallel.py``).
"""

from megatron.core.pipeline_parallel import p2p_communication, schedules

from megatron_longstraw.patches.cpu_optimizer_device import needed, use_cpu_torch

_MODULES = (schedules, p2p_communication)
__all__ = ["needed", "apply", "revert"]  # needed(): no usable GPU, as cpu_optimizer_device


def apply() -> None:
    """Give the schedule and p2p modules the CPU ``torch``."""
    use_cpu_torch(_MODULES)


def revert() -> None:
    """Give them the real ``torch`` back."""
    use_cpu_torch(_MODULES, cpu=False)
