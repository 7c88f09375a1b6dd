"""The GPUs the planner knows: usable memory, dense bf16 peak and memory bandwidth."""

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model."""

    name: str
    memory_gib: float
    """Memory a process can allocate, GiB (the H200's is measured: ``torch.cuda.mem_get_info``)."""
    bf16_tflops: float
    """Dense bf16 tensor-core peak of the datasheet; the H200's measured kernel rates
    (``kernels.py``) scale by this ratio to other GPUs."""
    hbm_tbps: float
    """Memory bandwidth of the datasheet (TB/s): decode and optimizer scale by it."""


# the H200's usable memory is measured (139.8 GiB of 144 GiB); the others keep the same 2.9%
_USABLE = 139.8 / 144.0

GPUS: dict[str, GpuSpec] = {
    "h200": GpuSpec("h200", 139.8, 989.0, 4.8),
    "h100": GpuSpec("h100", 80 * _USABLE, 989.0, 3.35),
    "h20": GpuSpec("h20", 96 * _USABLE, 148.0, 4.0),
    "b200": GpuSpec("b200", 180 * _USABLE, 2250.0, 8.0),
    "a100": GpuSpec("a100", 80 * _USABLE, 312.0, 2.039),
}
REFERENCE_GPU = GPUS["h200"]  # where kernels.py's rates were measured


def gpu_help() -> str:
    """The known GPU names, for ``--gpu``'s help."""
    return ", ".join(GPUS) + "."


def gib_of_gb(gb: float) -> float:
    """``gb`` GB (10^9 bytes, as the GPU flags take memory) in GiB (what the planner counts)."""
    return gb * 1e9 / 2 ** 30


def gpu_spec(name: str | None, memory_gb: float | None = None, tflops: float | None = None) -> GpuSpec:
    """The named GPU, with ``memory_gb`` (usable GiB) or ``tflops`` (dense bf16) overriding its
    figures; without a name both must be given (a GPU the table lacks)."""
    if name is None:
        if memory_gb is None or tflops is None:
            raise ValueError("--gpu NAME, or both --gpu-memory-gb and --gpu-tflops, must be given")
        return GpuSpec("custom", float(memory_gb), float(tflops), REFERENCE_GPU.hbm_tbps * tflops / REFERENCE_GPU.bf16_tflops)
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"--gpu {name}: unknown GPU; known: {', '.join(GPUS)} "
                         "(or give --gpu-memory-gb and --gpu-tflops)")
    spec = GPUS[key]
    return GpuSpec(spec.name, float(memory_gb) if memory_gb is not None else spec.memory_gib,
                   float(tflops) if tflops is not None else spec.bf16_tflops, spec.hbm_tbps)
