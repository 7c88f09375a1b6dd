"""The trainer's start-up plan: the planner's line for this run's own layout, and a refusal,
before any weight is allocated, of a run predicted not to fit the GPU (``--no-plan-check``
skips the refusal)."""

import re

import torch

from megatron_longstraw.config.trainer import TrainerConfig
from megatron_longstraw.data.prompts import resolve_max_prompt_length
from megatron_longstraw.planning.hardware import GPUS, GpuSpec
from megatron_longstraw.planning.layouts import Layout
from megatron_longstraw.planning.memory import PEAK_ERROR
from megatron_longstraw.planning.planner import LayoutPlan, fastest_fitting, max_prompt, model_profile, plan_all, plan_layout
from megatron_longstraw.planning.run import RunShape

GiB = 2 ** 30


def trainer_prompt_length(config: TrainerConfig, hf: dict) -> tuple[int, str]:
    """The longest prompt the run will see and the flag that sets it: the synthetic task's length,
    else the prompt budget (``--max-prompt-length``, or the positions left by the responses)."""
    data = config.data
    if config.synthetic_task:
        lengths = [(data.longest_synthetic_prompt, data.synthetic_length_flag)]
        if config.evaluation.enabled:  # the held-out prompts are captured by the same GPUs
            lengths.append((max(config.eval_lengths), "--eval-prompt-lengths"))
        return max(lengths, key=lambda pair: pair[0])
    budget = resolve_max_prompt_length(data.max_prompt_length, hf["max_position_embeddings"],
                                       config.rollout.max_response_length)
    return max(budget or 1, 1), "--max-prompt-length"


def trainer_run(config: TrainerConfig, hf: dict) -> tuple[Layout, RunShape]:
    """This run's layout and step shape, as the planner sees them."""
    layout = Layout.of(config.parallel.sizes, config.data_parallel_size)
    run = RunShape.of(config, prompt_length=trainer_prompt_length(config, hf)[0],
                      response_length=config.rollout.max_response_length,
                      precision="bf16" if config.precision.bf16 else "fp32")
    return layout, run


def this_gpu() -> GpuSpec | None:
    """The CUDA device's spec (its own total memory), ``None`` on a CPU."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    total = torch.cuda.mem_get_info()[1] / GiB
    match = re.search(r"\b(H200|H100|H20|B200|A100)\b", name.upper())
    known = GPUS[match.group(1).lower()] if match else GPUS["h200"]  # unknown: the H200's rates
    return GpuSpec(known.name if match else name, total, known.bf16_tflops, known.hbm_tbps)


def _what_fits(profile, hf: dict, layout: Layout, run: RunShape, gpu: GpuSpec, prompt_flag: str) -> str:
    """A layout of the same GPUs that fits, else the largest prompt this layout fits."""
    best = fastest_fitting(plan_all(profile, run, gpu, layout.world, hf))
    if best is not None:
        return f"the layout {best.layout.label()} fits ({best.memory.peak:.1f} GiB predicted)"
    fixed = dict(tp=layout.tp, cp=layout.cp, pp=layout.pp, vpp=layout.vpp, ep=layout.ep, dp=layout.dp)
    length, _ = max_prompt(profile, run, gpu, layout.world, hf=hf, **fixed)
    if length:
        return f"a prompt of at most {length:,} tokens fits this layout ({prompt_flag})"
    return "no layout of these GPUs fits it"


def check_plan(config: TrainerConfig, hf: dict, rank0: bool) -> LayoutPlan | None:
    """Print the plan's line for this run (rank 0) and refuse a run predicted to exceed the GPU's
    memory by more than the planner's error (``ValueError``); ``None`` when the model's family has
    no ``plan_profile`` or the run is the full-graph baseline. Under Transformer Engine (whose
    fused layers keep less than the local spec the planner models) the line is printed only."""
    if config.longstraw.replay_mode != "longstraw":
        return None
    profile = model_profile(hf)
    if profile is None:
        return None
    layout, run = trainer_run(config, hf)
    prompt_flag = trainer_prompt_length(config, hf)[1]
    gpu = this_gpu()
    plan = plan_layout(profile, layout, run, gpu or GPUS["h200"])
    if rank0:
        where = "" if gpu else ", planned for an H200: no GPU here"
        print(f"plan (prompt {run.prompt_length:,} tokens{where}): {plan.line()}", flush=True)
    refuse = gpu is not None and not config.longstraw.no_plan_check and config.model.transformer_impl == "local"
    if refuse and plan.memory.peak > gpu.memory_gib * (1 + PEAK_ERROR):
        raise ValueError(
            f"this run is predicted to need {plan.memory.peak:.1f} GiB per GPU, over the {gpu.memory_gib:.1f} GiB "
            f"of this {gpu.name} by more than the planner's {PEAK_ERROR:.0%} error; "
            f"{_what_fits(profile, hf, layout, run, gpu, prompt_flag)}"
            " (python tools/plan_budget.py plans every layout; --no-plan-check skips this check)")
    return plan
