"""The planner's flags (shared by ``tools/plan_budget.py``) and its console table."""

import argparse
from dataclasses import dataclass, field

from megatron_longstraw.models.presets import resolve_hf_config, with_num_layers
from megatron_longstraw.models.profile import ModelProfile
from megatron_longstraw.planning.hardware import GPUS, GpuSpec, gib_of_gb, gpu_spec
from megatron_longstraw.planning.memory import ALLOWANCE
from megatron_longstraw.planning.planner import CHUNK_SIZES, LayoutPlan, fastest_fitting, model_profile, plan_all
from megatron_longstraw.planning.run import PRECISIONS, RunShape


@dataclass
class PlanRequest:
    """A parsed planner command line."""

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


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The planner's flags, in Megatron-style groups (the trainer's names where they exist)."""
    g = parser.add_argument_group("model and GPUs")
    g.add_argument("--model", default=None, help="preset name, HF folder or config.json (required)")
    g.add_argument("--num-layers", type=int, default=None, help="keep only the first N decoder layers")
    g.add_argument("--num-gpus", type=int, default=1, help="GPUs of the run")
    g.add_argument("--gpu", default=None, help=f"GPU model: {', '.join(GPUS)} (default h200 unless "
                   "--gpu-memory-gb and --gpu-tflops describe another)")
    g.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="usable GPU memory in GB of 10^9 bytes (overrides --gpu's; an H200 has 150.1 usable)")
    g.add_argument("--gpu-tflops", type=float, default=None, help="dense bf16 peak TFLOP/s (overrides --gpu's)")
    g = parser.add_argument_group("run")
    g.add_argument("--prompt-length", type=int, default=1 << 20, help="prompt tokens")
    g.add_argument("--response-length", type=int, default=8192, help="tokens per response")
    g.add_argument("--num-generations", type=int, default=8, help="G: responses per prompt")
    g.add_argument("--prompt-gradient", default="detached", choices=["detached", "exact"],
                   help="detached (replay only) or exact (state gradients and the prompt backward sweep)")
    g.add_argument("--global-batch-size", type=int, default=1, help="prompt groups per step over all DP ranks")
    g.add_argument("--rollout-source", default="internal", choices=["internal", "jsonl"],
                   help="internal: decode the G responses (timed); jsonl: responses from a file")
    g.add_argument("--prompt-chunk-size", type=int, default=None,
                   help=f"capture chunk tokens (default: try {', '.join(f'{c:,}' for c in CHUNK_SIZES)})")
    g.add_argument("--replay-micro-batch-size", type=int, default=1, help="responses per replay micro-batch")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "none"],
                   help="full: replay recomputes each layer in backward (the trainer's flag); none: keeps "
                   "activations (default: try both)")
    g.add_argument("--precision", default="bf16", choices=list(PRECISIONS),
                   help="bf16: the trainer with --bf16 (fp32 gradients, main weights and Adam); fp32: "
                   "without; bench: tools/bench_longstraw.py (bf16 gradients and Adam moments)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="under TP shard the activations between layers too (the trainer's flag; not with CP)")
    g.add_argument("--kl-coef", type=float, default=0.0, help="> 0: a frozen reference copy of the weights is kept")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard optimizer states over data-parallel ranks (the trainer's flag)")
    g = parser.add_argument_group("layout (unset: every valid size)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=None, help="fix TP")
    g.add_argument("--context-parallel-size", type=int, default=None, help="fix CP")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=None, help="fix PP")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None, help="fix virtual stages")
    g.add_argument("--expert-model-parallel-size", type=int, default=None, help="fix EP")
    g.add_argument("--data-parallel-size", type=int, default=None, help="fix DP")


def plan_from_args(args: argparse.Namespace) -> PlanRequest:
    """Validate the flags (``ValueError`` naming the flag) and build the request."""
    if not args.model:
        raise ValueError("--model is required (a preset name, HF folder or config.json)")
    hf = resolve_hf_config(args.model)
    if args.num_layers is not None:
        hf = with_num_layers(hf, args.num_layers)
    for flag, value in (("--num-gpus", args.num_gpus), ("--gpu-memory-gb", args.gpu_memory_gb),
                        ("--gpu-tflops", args.gpu_tflops), ("--prompt-chunk-size", args.prompt_chunk_size)):
        if value is not None and value <= 0:
            raise ValueError(f"{flag} {value}: must be positive")
    custom = args.gpu is None and args.gpu_memory_gb is not None and args.gpu_tflops is not None
    memory_gib = gib_of_gb(args.gpu_memory_gb) if args.gpu_memory_gb is not None else None
    gpu = gpu_spec(None if custom else (args.gpu or "h200"), memory_gib, args.gpu_tflops)
    run = RunShape(prompt_length=args.prompt_length, response_length=args.response_length,
                   num_generations=args.num_generations, prompt_gradient=args.prompt_gradient,
                   chunk_size=args.prompt_chunk_size or CHUNK_SIZES[-2], micro_batch_size=args.replay_micro_batch_size,
                   precision=args.precision, distributed_optimizer=args.use_distributed_optimizer,
                   rollout="internal" if args.rollout_source == "internal" else "file",
                   global_batch_size=args.global_batch_size, recompute=args.recompute_granularity == "full",
                   sequence_parallel=args.sequence_parallel, reference_model=args.kl_coef > 0)
    fixed = dict(tp=args.tensor_model_parallel_size, cp=args.context_parallel_size,
                 pp=args.pipeline_model_parallel_size, vpp=args.num_virtual_stages_per_pipeline_rank,
                 ep=args.expert_model_parallel_size, dp=args.data_parallel_size)
    for flag, value in fixed.items():
        if value is not None and value < 1:
            raise ValueError(f"a parallel size must be at least 1 ({flag}={value})")
    profile = model_profile(hf)
    if profile is None:
        raise ValueError(f"--model {args.model}: the family of model_type {hf['model_type']!r} has no plan_profile, "
                         "so the planner cannot plan it")
    return PlanRequest(profile, hf, run, gpu, args.num_gpus, {k: v for k, v in fixed.items() if v},
                       None if args.prompt_chunk_size else CHUNK_SIZES,
                       None if args.recompute_granularity else (False, True))


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
