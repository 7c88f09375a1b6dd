"""CPU patch: Megatron's CUDA RNG-states tracker keeps CPU generator states instead.

``model_parallel_cuda_manual_seed`` and every ``get_cuda_rng_tracker().fork()`` (weight init,
dropout, activation recompute) read and write ``torch.cuda`` generator states. Without a GPU
those calls fail; this patch swaps the tracker class and the two state helpers in
``megatron.core.tensor_parallel.random`` for CPU-generator versions with the same names and
seeding, so TP/EP seeding semantics (distinct streams per rank) are kept on the CPU.
"""

import contextlib

import torch
from megatron.core.tensor_parallel import random as mcore_random

_ORIGINALS = {
    name: getattr(mcore_random, name)
    for name in ("CudaRNGStatesTracker", "_get_cuda_rng_state", "_set_cuda_rng_state")
}


def _get_cpu_rng_state(*args, clone: bool = False, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


class CpuRNGStatesTracker(_ORIGINALS["CudaRNGStatesTracker"]):
    """``CudaRNGStatesTracker`` whose named states live in the CPU generator."""

    def add(self, name, seed):
        """Track a new named state seeded with ``seed`` (same checks as Megatron's)."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name=mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Run the block under the named CPU state, then restore the caller's state."""
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def needed() -> bool:
    """True when this process has no usable GPU."""
    return not torch.cuda.is_available()


def apply() -> None:
    """Install the CPU tracker class and CPU state helpers in Megatron's random module."""
    mcore_random.CudaRNGStatesTracker = CpuRNGStatesTracker
    mcore_random._get_cuda_rng_state = _get_cpu_rng_state
    mcore_random._set_cuda_rng_state = _set_cpu_rng_state
    mcore_random.initialize_rng_tracker(force_reset=True)


def revert() -> None:
    """Restore Megatron's CUDA tracker and helpers."""
    for name, value in _ORIGINALS.items():
        setattr(mcore_random, name, value)
    mcore_random.initialize_rng_tracker(force_reset=True)
