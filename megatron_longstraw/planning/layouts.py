"""The parallel layouts of a GPU count that a model admits."""

import itertools
from dataclasses import dataclass

from megatron_longstraw.config.parallel import ParallelSizes

from megatron_longstraw.models.profile import ModelProfile


@dataclass(frozen=True)
class Layout:
    """One way to spread a run over ``world`` GPUs (Megatron's sizes; EP over DP x CP ranks)."""

    tp: int = 1
    """``--tensor-model-parallel-size``."""
    cp: int = 1
    """``--context-parallel-size``."""
    pp: int = 1
    """``--pipeline-model-parallel-size``."""
    vpp: int = 1
    """``--num-virtual-stages-per-pipeline-rank``."""
    ep: int = 1
    """``--expert-model-parallel-size`` (over the DP x CP ranks)."""
    dp: int = 1
    """Data-parallel replicas: the GPUs over TP x CP x PP."""

    @property
    def world(self) -> int:
        """GPUs the layout uses."""
        return self.tp * self.cp * self.pp * self.dp

    @classmethod
    def of(cls, sizes: ParallelSizes, dp: int) -> "Layout":
        """The layout of Megatron's model-parallel ``sizes`` with ``dp`` data-parallel replicas."""
        return cls(tp=sizes.tensor, cp=sizes.context, pp=sizes.pipeline, vpp=sizes.virtual_pipeline,
                   ep=sizes.expert, dp=dp)

    def parallel_sizes(self) -> ParallelSizes:
        """Its model-parallel sizes as the trainer holds them."""
        return ParallelSizes(self.tp, self.cp, self.ep, self.pp, self.vpp)

    def label(self) -> str:
        """``TP2 CP4 PP1 DP1`` (virtual stages and EP shown when used)."""
        parts = [f"TP{self.tp}", f"CP{self.cp}", f"PP{self.pp}"]
        if self.vpp > 1:
            parts.append(f"VPP{self.vpp}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        parts.append(f"DP{self.dp}")
        return " ".join(parts)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_problem(profile: ModelProfile, layout: Layout) -> str | None:
    """Why ``layout`` cannot serve the model (one line), or ``None``."""
    if any(size < 1 for size in (layout.tp, layout.cp, layout.pp, layout.vpp, layout.ep, layout.dp)):
        return "every parallel size must be at least 1"
    bad_tp = [d for d in profile.tp_divisors if d % layout.tp]
    if bad_tp:
        return f"--tensor-model-parallel-size {layout.tp} does not divide the model's head/FFN count {bad_tp[0]}"
    layers = len(profile.layers)
    if layers % (layout.pp * layout.vpp):
        return (f"--pipeline-model-parallel-size {layout.pp} x {layout.vpp} virtual stages does not divide "
                f"the model's {layers} layers")
    if layout.vpp > 1 and layout.pp == 1:
        return "virtual pipeline stages need --pipeline-model-parallel-size > 1"
    if layout.ep > 1:
        if not profile.num_experts:
            return f"--expert-model-parallel-size {layout.ep}: the model has no routed experts"
        if profile.num_experts % layout.ep:
            return (f"--expert-model-parallel-size {layout.ep} does not divide the model's "
                    f"{profile.num_experts} experts")
        if (layout.dp * layout.cp) % layout.ep:
            return (f"--expert-model-parallel-size {layout.ep} must divide data x context parallel "
                    f"size {layout.dp * layout.cp}")
    return None


def candidate_layouts(profile: ModelProfile, num_gpus: int, *, tp=None, cp=None, pp=None, vpp=None, ep=None,
                      dp=None, max_vpp: int = 4) -> list[Layout]:
    """Every valid layout of ``num_gpus`` GPUs, the given sizes fixed."""
    if num_gpus < 1:
        raise ValueError(f"--num-gpus {num_gpus}: must be at least 1")
    sizes = _divisors(num_gpus)
    out = []
    for t, c, p in itertools.product([tp] if tp else sizes, [cp] if cp else sizes, [pp] if pp else sizes):
        if num_gpus % (t * c * p) or (dp and num_gpus // (t * c * p) != dp):
            continue
        d = num_gpus // (t * c * p)
        virtual = [vpp] if vpp else range(1, (max_vpp if p > 1 else 1) + 1)
        experts = [ep] if ep else [1, *(x for x in _divisors(d * c) if x > 1 and profile.num_experts)]
        for v, e in itertools.product(virtual, experts):
            layout = Layout(t, c, p, v, e, d)
            if layout_problem(profile, layout) is None:
                out.append(layout)
    return out
