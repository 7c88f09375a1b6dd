"""The planner's question from its configuration (``config/planner.py``) and its console table."""

from dataclasses import dataclass, field

from megatron_longstraw.config.planner import PlannerConfig
from megatron_longstraw.models.profile import ModelProfile
from megatron_longstraw.planning.hardware import GpuSpec, gib_of_gb, gpu_spec
from megatron_longstraw.planning.memory import ALLOWANCE
from megatron_longstraw.planning.planner import CHUNK_SIZES, LayoutPlan, fastest_fitting, model_profile, plan_all
from megatron_longstraw.planning.run import RunShape

# the planner's layout fields and the configuration fields that fix them ("group.field")
_LAYOUT_FIELDS = (("tp", "parallel.tensor_model_parallel_size"), ("cp", "parallel.context_parallel_size"),
                  ("pp", "parallel.pipeline_model_parallel_size"),
                  ("vpp", "parallel.num_virtual_stages_per_pipeline_rank"),
                  ("ep", "parallel.expert_model_parallel_size"), ("dp", "query.data_parallel_size"))


@dataclass
class PlanRequest:
    """A planner question: what to plan, and which settings to search."""

    profile: ModelProfile
    """The model (its family's ``plan_profile``)."""
    hf: dict
    """Its config (for the family's layout check)."""
    run: RunShape
    """The step's shape."""
    gpu: GpuSpec
    """The GPU model."""
    num_gpus: int
    """GPUs of the run."""
    fixed: dict = field(default_factory=dict)
    """Layout sizes the command line fixed (``Layout`` field names)."""
    chunk_sizes: tuple[int, ...] | None = None
    """Chunk sizes to try (``None``: the run's ``--prompt-chunk-size``, given)."""
    recompute: tuple[bool, ...] | None = None
    """Activation recomputation settings to try (``None``: the run's, given)."""

    def plans(self) -> list[LayoutPlan]:
        return plan_all(self.profile, self.run, self.gpu, self.num_gpus, self.hf, self.chunk_sizes, self.recompute,
                        **self.fixed)


def plan_request(config: PlannerConfig, given: frozenset[str], hf: dict) -> PlanRequest:
    """The question of a planner command line: ``config`` (its flags ``given``, the others at the
    trainer's defaults) for the model ``hf``. The layout sizes, ``--prompt-chunk-size`` and
    ``--recompute-granularity`` the command line does not give are searched."""
    hardware, query = config.hardware, config.query
    custom = hardware.gpu is None and hardware.gpu_memory_gb is not None and hardware.gpu_tflops is not None
    memory_gib = gib_of_gb(hardware.gpu_memory_gb) if hardware.gpu_memory_gb is not None else None
    gpu = gpu_spec(None if custom else (hardware.gpu or "h200"), memory_gib, hardware.gpu_tflops)
    run = RunShape.of(config, prompt_length=config.workload.prompt_length,
                      response_length=config.workload.response_length, precision=query.precision)
    values = {"parallel": config.parallel, "query": query}
    fixed = {name: getattr(values[key.split(".")[0]], key.split(".")[1])
             for name, key in _LAYOUT_FIELDS if key in given}
    profile = model_profile(hf)
    if profile is None:
        raise ValueError(f"--model {config.model.spec}: the family of model_type {hf['model_type']!r} has no "
                         "plan_profile, so the planner cannot plan it")
    return PlanRequest(profile, hf, run, gpu, hardware.num_gpus, fixed,
                       None if "longstraw.prompt_chunk_size" in given else CHUNK_SIZES,
                       None if "model.recompute_granularity" in given else (False, True))


def render_table(request: PlanRequest, plans: list[LayoutPlan]) -> str:
    """The console table: one row per layout, memory parts (GiB) and phase times (s)."""
    run, gpu = request.run, request.gpu
    best = fastest_fitting(plans)
    lines = [f"{request.profile.name}: prompt {run.prompt_length:,} + {run.response_length:,} tokens, "
             f"G={run.num_generations}, {run.prompt_gradient} prompt gradients, {run.precision}, "
             f"on {request.num_gpus} x {gpu.name} ({gpu.memory_gib:.1f} GiB)",
             f"peak = floor + {ALLOWANCE:.0%} allowance; memory in GiB on the busiest GPU, times in s per step", "",
             "| layout | chunk | weights | grads | optim | state | state grad | act | peak | fits | capture | decode "
             "| replay | prompt bwd | step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in plans:
        m, t = p.memory, p.time
        act = max(m.capture_transients, m.replay_activations, m.sweep_activations)
        mark = " (fastest)" if p is best else ""
        again = " recompute" if p.run.recompute else ""
        lines.append(f"| {p.layout.label()}{again}{mark} | {p.run.chunk_size:,} | {m.weights:.1f} | {m.gradients:.1f} | {m.optimizer:.1f} "
                     f"| {m.prompt_state:.1f} | {m.state_gradients:.1f} | {act:.1f} | {m.peak:.1f} "
                     f"| {'yes' if p.fits else 'no'} | {t.capture:.1f} | {t.decode:.1f} | {t.replay:.1f} "
                     f"| {t.prompt_backward:.1f} | {t.step:.1f} |")
    lines.append("")
    lines.append(f"fastest that fits: {best.line()}" if best else "no layout fits")
    return "\n".join(lines)
