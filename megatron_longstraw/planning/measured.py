"""The benchmark's measured runs (``docs/bench/bench_*.json``) beside the planner's predictions.

Each JSON holds the command that made it; a point's layout and run shape are read back from that
command and its result, planned for one H200 with the benchmark's precision, and compared.
"""

import json
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

from megatron_longstraw.models.presets import resolve_hf_config, with_num_layers
from megatron_longstraw.models.profile import ModelProfile
from megatron_longstraw.planning.hardware import GPUS, gib_of_gb
from megatron_longstraw.planning.layouts import Layout
from megatron_longstraw.planning.planner import LayoutPlan, model_profile, plan_layout
from megatron_longstraw.planning.run import RunShape

_DEFAULTS = {"--prompt-chunk-size": "32768", "--replay-micro-batch-size": "1", "--prompt-gradient": "detached",
             "--context-parallel-size": "1", "--pipeline-model-parallel-size": "1",
             "--num-virtual-stages-per-pipeline-rank": "1", "--transformer-impl": "local",
             "--warmup-prompt-length": None, "--num-layers": None, "--model": "qwen3.5-0.8b",
             "--memory-limit-gb": None}

DEFAULT_WARMUP = 65536  # tools/bench_longstraw.py --warmup-prompt-length
COLD_RUNS = {  # runs made before the benchmark had a warm-up point (their first point compiled)
    "bench_qwen3.5-0.8b.json": "its first point (capture 93.3 s, first replay 174.8 s) compiled the kernels: "
                               "longstraw_benchmark.md marks it '(compile)'",
}


COLD_POINTS = {  # points whose times carry one-time costs the warm-up did not take, with the evidence
    ("bench_qwen3.5-0.8b_plan_check_32gb.json", 0): "capture 14.7 s at 324,608 tokens, 10.8 s at 357,376 in the same "
                                                   "run: the first point after a 4K warm-up met 75 new chunk shapes",
    ("bench_qwen3.5-0.8b_plan_check_32gb_edge.json", 0): "capture 13.9 s at 324,608 tokens, 9.3 s at 340,992 in the "
                                                        "same run: the first point after a 64K warm-up met 63 new "
                                                        "chunk shapes",
}

UNMODELED_TIMES = {  # runs whose times the planner's rates do not model yet, with the evidence
    "bench_qwen3.6-35b-a3b_35b-a3b-8l-1m.json": "Qwen3.5-MoE's 256-expert layers run Megatron's SequentialMLP, one "
                                               "expert after another: capture 2.0x and replay 4.7x the rate "
                                               "model's times (qwen3.6-35b-a3b_1m.md); its peak is compared",
}


@dataclass
class MeasuredPoint:
    """One measured benchmark point and its plan."""

    file: str
    """The JSON's file name."""
    index: int
    """The point's index in its ``results``."""
    command: str
    """The benchmark command that measured it."""
    flags: dict
    """The command's flags the plan needs (with the benchmark's defaults)."""
    result: dict
    """The measured point."""
    profile: ModelProfile
    """Its model (the command's ``--model`` and ``--num-layers``)."""
    plan: LayoutPlan
    """Its plan (one H200, the benchmark's precision, no decode)."""

    @property
    def cold(self) -> bool:
        """Its times include kernel compilation: the first point of a run whose warm-up prompt
        was shorter than one capture chunk (the chunk's kernels compiled in the first measured
        point), or of a run made before the benchmark warmed up at all (``COLD_RUNS``), or a point
        whose one-time costs its run shows (``COLD_POINTS``)."""
        if (self.file, self.index) in COLD_POINTS:
            return True
        if self.index != 0:
            return False
        if self.file in COLD_RUNS:
            return True
        warmup = self.result.get("warmup_prompt_length", self.flags["--warmup-prompt-length"] or DEFAULT_WARMUP)
        return int(warmup) < int(self.flags["--prompt-chunk-size"])

    @property
    def times_modeled(self) -> bool:
        """The planner's rates model its times (not a run of ``UNMODELED_TIMES``)."""
        return self.file not in UNMODELED_TIMES

    @property
    def oom(self) -> bool:
        """The point ran out of memory (its plan must not fit)."""
        return bool(self.result.get("oom"))

    def measured(self) -> dict:
        """Measured peak (GiB) and times (s; replay per response); ``None`` where not measured
        (an out-of-memory point has none)."""
        r = self.result
        if self.oom:
            return dict(peak=None, capture=None, replay=None, prompt_backward=None)
        replay = r.get("replay_s") or []
        return dict(peak=r.get("peak_gib"), capture=r.get("capture_s"),
                    replay=sum(replay) / len(replay) if replay else None, prompt_backward=r.get("prompt_backward_s"))

    def predicted(self) -> dict:
        """Planned peak (GiB) and times (s; replay per response)."""
        t, m = self.plan.time, self.plan.memory
        return dict(peak=m.peak, capture=t.capture, replay=t.replay / self.result["group"],
                    prompt_backward=t.prompt_backward if self.result.get("prompt_backward_s") is not None else None)


def _flags(command: str) -> dict:
    words = shlex.split(command)
    flags = dict(_DEFAULTS)
    for i, word in enumerate(words):
        if word in flags and i + 1 < len(words):
            flags[word] = words[i + 1]
    return flags


ARTIFACT_OOMS = {  # out-of-memory points whose cause was the benchmark itself, not the run
    ("bench_qwen3.5-0.8b_exact_1m.json", 1): "measured after a G=2 point whose metered graphs the benchmark's "
                                            "saved-tensor meter kept alive (fixed since; exact_prompt_gradient.md)",
}


def bench_plan(profile: ModelProfile, *, cp: int, pp: int, vpp: int, prompt_length: int, response_length: int,
               group: int, prompt_gradient: str, chunk_size: int, micro_batch_size: int,
               memory_gib: float | None = None) -> LayoutPlan:
    """The plan of one benchmark point (``tools/bench_longstraw.py``): one H200 per CP x PP rank
    (with ``memory_gib`` of its memory: ``--memory-limit-gb``), its precision (bf16 gradients and
    Adam moments, no distributed optimizer), no decoding."""
    run = RunShape(prompt_length=prompt_length, response_length=response_length, num_generations=group,
                   prompt_gradient=prompt_gradient, chunk_size=chunk_size, micro_batch_size=micro_batch_size,
                   precision="bench", distributed_optimizer=False, rollout="file")
    gpu = GPUS["h200"] if memory_gib is None else replace(GPUS["h200"], memory_gib=memory_gib)
    return plan_layout(profile, Layout(cp=cp, pp=pp, vpp=vpp), run, gpu)


def plannable(result: dict, flags: dict, name: str = "", index: int = 0) -> str | None:
    """Why a measured point is not a planned run (``None``: it is). An out-of-memory point is
    planned: its predicted peak must exceed the GPU (``MeasuredPoint.oom``)."""
    if result.get("mode") != "longstraw":
        return "the full-graph baseline (a reference, not a LongStraw layout)"
    if (name, index) in ARTIFACT_OOMS:
        return "ran out of memory, " + ARTIFACT_OOMS[(name, index)]
    if flags["--transformer-impl"] != "local":
        return "Transformer Engine layers (the planner models Megatron's local spec)"
    return None


def measured_points(folder: str | Path) -> tuple[list[MeasuredPoint], list[tuple[str, int, str]]]:
    """Every plannable point of ``folder``'s ``bench_*.json``, and the others with the reason."""
    if not Path(folder).is_dir():
        raise ValueError(f"--against {folder}: no such folder")
    points, skipped = [], []
    for path in sorted(Path(folder).glob("bench_*.json")):
        try:
            data = json.loads(path.read_text())
            flags = _flags(data["command"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}: not a benchmark result (JSON with 'command' and 'results')") from None
        hf = resolve_hf_config(flags["--model"])
        if flags["--num-layers"]:
            hf = with_num_layers(hf, int(flags["--num-layers"]))
        profile = model_profile(hf)
        for index, result in enumerate(data["results"]):
            reason = plannable(result, flags, path.name, index)
            if reason:
                skipped.append((path.name, index, reason))
                continue
            plan = bench_plan(profile, cp=int(flags["--context-parallel-size"]),
                              pp=int(flags["--pipeline-model-parallel-size"]),
                              vpp=int(flags["--num-virtual-stages-per-pipeline-rank"]),
                              prompt_length=result["prompt_length"], response_length=result["response_length"],
                              group=result["group"], prompt_gradient=result.get("prompt_gradient", "detached"),
                              chunk_size=int(flags["--prompt-chunk-size"]),
                              micro_batch_size=int(flags["--replay-micro-batch-size"]),
                              memory_gib=(gib_of_gb(float(flags["--memory-limit-gb"]))
                                          if flags["--memory-limit-gb"] else None))
            points.append(MeasuredPoint(path.name, index, data["command"], flags, result, profile, plan))
    return points, skipped


def comparison_table(folder: str | Path) -> str:
    """Markdown: every plannable point's predicted against measured peak and times, then the
    points not planned and why."""
    points, skipped = measured_points(folder)

    def cell(point, key, spec):
        measured, predicted = point.measured()[key], point.predicted()[key]
        if measured is None or predicted is None:
            return ""
        return f"{predicted:{spec}} / {measured:{spec}} ({predicted / measured - 1:+.1%})"

    lines = ["| run | point | layout | prompt | G | peak GiB | capture s | replay s / response | prompt backward s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in points:
        r = p.result
        mode = " exact" if r.get("prompt_gradient") == "exact" else ""
        cold = "" if p.oom else (" (times not modeled)" if not p.times_modeled else
                                 " (cold: times not compared)" if p.cold else "")
        if p.oom:
            lines.append(f"| `{p.file}` | {p.index} | {p.plan.layout.label()}{mode} | {r['prompt_length']:,} "
                         f"| {r['group']} | {p.plan.memory.peak:.2f} / out of memory | | | |")
            continue
        lines.append(f"| `{p.file}` | {p.index}{cold} | {p.plan.layout.label()}{mode} | {r['prompt_length']:,} "
                     f"| {r['group']} | {cell(p, 'peak', '.2f')} | {cell(p, 'capture', '.1f')} "
                     f"| {cell(p, 'replay', '.2f')} | {cell(p, 'prompt_backward', '.1f')} |")
    if skipped:
        lines += ["", "Not planned:", ""]
        lines += [f"- `{name}` point {index}: {reason}" for name, index, reason in skipped]
    return "\n".join(lines)
