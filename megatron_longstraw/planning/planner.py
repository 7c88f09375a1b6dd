"""Every layout's plan for a run, the fastest that fits, the largest prompt that fits."""

from dataclasses import dataclass, replace

from megatron_longstraw.models.profile import ModelProfile
from megatron_longstraw.models.registry import family_for
from megatron_longstraw.planning.hardware import GpuSpec
from megatron_longstraw.planning.layouts import Layout, candidate_layouts, layout_problem
from megatron_longstraw.planning.memory import MemoryPlan, memory_plan
from megatron_longstraw.planning.run import RunShape
from megatron_longstraw.planning.timing import TimePlan, time_plan

PROMPT_GRANULE = 1024
"""``--max-prompt`` answers in multiples of this many tokens."""
CHUNK_SIZES = (4096, 8192, 16384, 32768, 65536)
"""``--prompt-chunk-size`` values tried when the run does not fix one."""


@dataclass(frozen=True)
class LayoutPlan:
    """One layout's predicted memory and time, and whether it fits the GPU."""

    layout: Layout
    memory: MemoryPlan
    time: TimePlan
    gpu_memory_gib: float
    run: RunShape

    @property
    def fits(self) -> bool:
        return self.memory.peak <= self.gpu_memory_gib

    def line(self) -> str:
        """One line: layout, peak against the GPU, step time."""
        verdict = "fits" if self.fits else "does not fit"
        t = self.time
        again = ", recompute full" if self.run.recompute else ""
        return (f"{self.layout.label()}, chunks of {self.run.chunk_size:,}{again}: peak {_num(self.memory.peak)} GiB of {self.gpu_memory_gib:.1f} "
                f"({verdict}), step {_num(t.step)} s (capture {_num(t.capture)}, decode {_num(t.decode)}, "
                f"replay {_num(t.replay)}, prompt backward {_num(t.prompt_backward)}, optimizer {_num(t.optimizer)})")

    def as_dict(self) -> dict:
        return dict(layout=self.layout.__dict__ | {"label": self.layout.label()}, fits=self.fits,
                    prompt_chunk_size=self.run.chunk_size, recompute_granularity="full" if self.run.recompute else None,
                    gpu_memory_gib=self.gpu_memory_gib, memory_gib=self.memory.as_dict(), seconds=self.time.as_dict())


def _num(x: float) -> str:
    """A figure for the console: one decimal, three digits below 1, thousands separated."""
    return f"{x:,.1f}" if x >= 1 else f"{x:.3f}"


def model_profile(hf: dict) -> ModelProfile | None:
    """The planner's view of a config; ``None`` when its family has no ``plan_profile`` (an
    optional part of the family API); ``ValueError`` for a model type without a family."""
    build = family_for(hf["model_type"]).plan_profile
    return build(hf) if build is not None else None


def plan_layout(profile: ModelProfile, layout: Layout, run: RunShape, gpu: GpuSpec) -> LayoutPlan:
    """One layout's plan."""
    memory = memory_plan(profile, layout, run)
    return LayoutPlan(layout, memory, time_plan(profile, layout, run, gpu, memory.prompt_state), gpu.memory_gib, run)


def run_problem(layout: Layout, run: RunShape, hf: dict | None = None,
                profile: ModelProfile | None = None) -> str | None:
    """Why the trainer would refuse ``run`` on ``layout`` (one line), or ``None``: the family's
    own layout check (``check_layout``, given the config), sequence parallelism's limits and the
    exact mode's."""
    if run.exact and layout.ep > 1 and max(layout.tp, layout.cp, layout.pp) > 1:
        return "--prompt-gradient exact with expert parallelism and TP, CP or PP is not served"
    if profile is not None and profile.tp_needs_sequence_parallel and layout.tp > 1 and layout.cp > 1:
        return (f"--tensor-model-parallel-size {layout.tp} needs --sequence-parallel for this model, which "
                f"--context-parallel-size {layout.cp} does not serve")
    if run.sequence_parallel and layout.tp > 1 and layout.cp > 1:
        return "--sequence-parallel is not served with --context-parallel-size > 1"
    if hf is not None:
        family = family_for(hf["model_type"])
        try:
            family.check_layout(family.normalize_hf_config(hf), layout.parallel_sizes(), "internal" if run.rollout == "internal" else "jsonl")
        except ValueError as err:
            return str(err)
    return None


def plan_all(profile: ModelProfile, run: RunShape, gpu: GpuSpec, num_gpus: int, hf: dict | None = None,
             chunk_sizes: tuple[int, ...] | None = None, recompute: tuple[bool, ...] | None = None,
             **fixed) -> list[LayoutPlan]:
    """Every valid layout of ``num_gpus`` (``fixed``: Layout field sizes held; ``hf``: the config,
    for its family's layout check) with each of ``chunk_sizes`` and ``recompute`` settings
    (``None``: the run's own), fits first, fastest first."""
    layouts = _layouts(profile, run, num_gpus, hf, fixed)
    plans = [plan_layout(profile, layout, r, gpu) for layout in layouts for r in _shapes(run, chunk_sizes, recompute)]
    return sorted(plans, key=lambda p: (not p.fits, p.time.step, p.memory.peak))


def _shapes(run: RunShape, chunk_sizes: tuple[int, ...] | None, recompute: tuple[bool, ...] | None) -> list[RunShape]:
    """``run`` with each of ``chunk_sizes`` and ``recompute`` settings (``None``: the run's own)."""
    return [replace(run, chunk_size=c, recompute=r) for c in (chunk_sizes or (run.chunk_size,))
            for r in (recompute or (run.recompute,))]


def _layouts(profile: ModelProfile, run: RunShape, num_gpus: int, hf: dict | None, fixed: dict) -> list[Layout]:
    """The layouts that serve the run (DP dividing the global batch); ``ValueError`` when none."""
    layouts = [x for x in candidate_layouts(profile, num_gpus, **fixed)
               if run_problem(x, run, hf, profile) is None and run.global_batch_size % x.dp == 0]
    if not layouts:
        raise ValueError(_no_layout(profile, run, num_gpus, hf, fixed))
    return layouts


def _no_layout(profile: ModelProfile, run: RunShape, num_gpus: int, hf: dict | None, fixed: dict) -> str:
    """Why no layout of ``num_gpus`` serves the run with the ``fixed`` sizes (one line)."""
    sizes = {k: v for k, v in fixed.items() if v}
    product = sizes.get("tp", 1) * sizes.get("cp", 1) * sizes.get("pp", 1) * sizes.get("dp", 1)
    if num_gpus % product:
        return f"the fixed parallel sizes ({product} GPUs) do not divide --num-gpus {num_gpus}"
    free = num_gpus // product
    implied = Layout(**{"dp": free, **sizes})
    reason = layout_problem(profile, implied) or run_problem(implied, run, hf, profile)
    return reason or f"no layout of {num_gpus} GPUs serves {profile.name} with these sizes"


def fastest_fitting(plans: list[LayoutPlan]) -> LayoutPlan | None:
    """The fastest plan that fits, or ``None``."""
    fitting = [p for p in plans if p.fits]
    return min(fitting, key=lambda p: p.time.step) if fitting else None


def max_prompt(profile: ModelProfile, run: RunShape, gpu: GpuSpec, num_gpus: int,
               max_step_seconds: float | None = None, limit: int = 1 << 27, hf: dict | None = None,
               chunk_sizes: tuple[int, ...] | None = None, recompute: tuple[bool, ...] | None = None,
               **fixed) -> tuple[int, LayoutPlan | None]:
    """The largest prompt (a multiple of ``PROMPT_GRANULE``, at most ``limit``) some layout fits,
    within ``max_step_seconds`` per step if given, and the fastest such plan; ``(0, None)`` when
    none does."""
    layouts = _layouts(profile, run, num_gpus, hf, fixed)
    shapes = _shapes(run, chunk_sizes, recompute)

    def ok(length: int) -> bool:  # memory first (cheap), the step time only where it must hold
        for shape in shapes:
            shaped = replace(shape, prompt_length=length)
            for layout in layouts:
                if memory_plan(profile, layout, shaped).peak > gpu.memory_gib:
                    continue
                if max_step_seconds is None or plan_layout(profile, layout, shaped, gpu).time.step <= max_step_seconds:
                    return True
        return False

    low, high = 0, limit // PROMPT_GRANULE
    while low < high:  # the largest k with ok(k * granule): memory and time grow with the prompt
        mid = (low + high + 1) // 2
        if ok(mid * PROMPT_GRANULE):
            low = mid
        else:
            high = mid - 1
    if low == 0:
        return 0, None
    plans = plan_all(profile, replace(run, prompt_length=low * PROMPT_GRANULE), gpu, num_gpus, hf, chunk_sizes,
                     recompute, **fixed)
    fitting = [p for p in plans if p.fits and (max_step_seconds is None or p.time.step <= max_step_seconds)]
    return low * PROMPT_GRANULE, min(fitting, key=lambda p: p.time.step)

