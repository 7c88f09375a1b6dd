"""Decode speed against the memory-bandwidth bound, beside Hugging Face ``generate``.

For each prompt length the prompt is captured once (``capture_prompt``), then G samples decode
``--new-tokens`` tokens from that one state (``generate_from_state``) for each G of
``--group-sizes``: the shared prompt pages are read once per step for all G samples, never
copied. Per point: the steady per-step time (after ``--warmup-steps``), tokens/s over the G
samples, the bytes a step must read (the weights, the prompt state, each sample's own decode
state) and the fraction of the GPU's bandwidth that reaches (``--hbm-tbps``, the H200's 4.8 by
default). Beside it, for each G of ``--hf-group-sizes``, transformers' ``generate`` on the same
weights, prompt and G (the prompt given G times, as sampling G responses does there: it prefills
G copies and keeps G caches): its wall time, prefill and steady per-step time (one call, timed by a
logits processor, after a warm-up on a short prompt) and peak memory, or where it runs out of
memory. ``--profile G`` adds the torch profiler's operator tables of G samples decoding. With
``--temperature 0`` both decode greedily and the tool records whether their tokens agree.

Example (one H200):
    python tools/bench_decode.py --model qwen3.5-0.8b --max-position-embeddings 1100000 \\
        --prompt-lengths 131072,524288,1048576 --group-sizes 1,8,32 --hf-group-sizes 8
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

from megatron_longstraw import console
from megatron_longstraw.config import cli
from megatron_longstraw.config.benchmark import BenchOutputConfig
from megatron_longstraw.config.grpo import RolloutConfig
from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.config.longstraw import LongStrawConfig
from megatron_longstraw.config.model import ModelConfig
from megatron_longstraw.config.parallel import ParallelSizes
from megatron_longstraw.config.workload import WorkloadConfig


def build_parser() -> argparse.ArgumentParser:
    """The tool's flags: the shared ones from the configuration (``config/``), its own below."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_flags(p, ModelConfig, only=("model", "max_position_embeddings", "yarn_factor"))
    cli.add_flags(p, WorkloadConfig, only=("prompt_lengths", "group_sizes"), about="G: samples decoded together")
    cli.add_flags(p, RolloutConfig, only=("temperature", "decode_cuda_graphs"))
    cli.add_flags(p, LongStrawConfig, only=("prompt_chunk_size",))
    cli.add_flags(p, KernelOptions, only=("decode_split_keys",))
    cli.add_flags(p, BenchOutputConfig)
    g = p.add_argument_group("decoding")
    g.add_argument("--hf-group-sizes", default="8",
                   help="comma-separated G for transformers' generate beside it ('' skips it) (default: 8)")
    g.add_argument("--new-tokens", type=int, default=64, help="tokens each sample decodes (no EOS stop) (default: 64)")
    g.add_argument("--warmup-steps", type=int, default=8,
                   help="first steps left out of the per-step time (default: 8)")
    g.add_argument("--hbm-tbps", type=float, default=4.8, help="the GPU's memory bandwidth, TB/s (H200: 4.8) "
                   "(default: 4.8)")
    g.add_argument("--profile", type=int, default=0, metavar="G",
                   help="also profile G samples decoding at each prompt length (operator tables beside the "
                        "results; default: 0, off)")
    return p


if __name__ == "__main__":
    build_parser().parse_args()  # --help and a bad flag answer before torch and Megatron load

console.quiet_third_party()  # before torch and Megatron load

import torch  # noqa: E402

from megatron_longstraw.checkpointing.model_checkpoint import model_hf_config  # noqa: E402
from megatron_longstraw.distributed import destroy_distributed, device, init_distributed  # noqa: E402
from megatron_longstraw.longstraw.capture import capture_prompt  # noqa: E402
from megatron_longstraw.models.builder import build_model  # noqa: E402
from megatron_longstraw.models.options import ModelOptions  # noqa: E402
from megatron_longstraw.models.registry import family_for  # noqa: E402
from megatron_longstraw.rollout.generate import generate_from_state  # noqa: E402
from bench_output import bench_stem, command_line, write_bench_files  # noqa: E402 (tools/, beside this script)

GiB = 2 ** 30


def parse_args(argv=None) -> argparse.Namespace:
    """The tool's flags, the shared ones checked by their configuration groups."""
    args = build_parser().parse_args(argv)
    for group in (ModelConfig, WorkloadConfig, RolloutConfig, LongStrawConfig, KernelOptions):
        cli.group_from(args, group)
    args.hf_group_sizes = [int(x) for x in args.hf_group_sizes.split(",") if x]
    if args.new_tokens < 2:
        raise ValueError(f"--new-tokens must be >= 2 (a step after the first token), got {args.new_tokens}")
    if not args.hbm_tbps > 0:
        raise ValueError(f"--hbm-tbps must be positive, got {args.hbm_tbps}")
    if args.new_tokens < args.warmup_steps + 2:  # transformers' steps are timed after its prefill's token
        raise ValueError(f"--new-tokens {args.new_tokens} must be at least --warmup-steps {args.warmup_steps} + 2")
    if args.warmup_steps < 0:
        raise ValueError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if args.profile < 0:
        raise ValueError(f"--profile must be >= 0 (samples; 0: off), got {args.profile}")
    if any(g < 1 for g in args.hf_group_sizes):
        raise ValueError("--hf-group-sizes: G must be >= 1")
    return args


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_peak():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib():
    return torch.cuda.max_memory_allocated() / GiB if torch.cuda.is_available() else None


def step_seconds(elapsed: list[float], warmup: int) -> float:
    """Mean seconds per step after ``warmup`` steps, from the elapsed time after each step."""
    assert len(elapsed) > warmup, (len(elapsed), warmup)
    start = elapsed[warmup - 1] if warmup else 0.0
    return (elapsed[-1] - start) / (len(elapsed) - warmup)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def reads_everything(hf: dict) -> bool:
    """Whether a decode step reads every weight and every prompt-state byte: not with DSA (only
    each query's selected latents) or MoE (only the routed experts), where the bytes counted are
    an upper bound of the reads and no bandwidth bound follows from them."""
    return not (hf.get("index_topk") or hf.get("n_routed_experts") or hf.get("num_experts"))


def ours(model, state, group: int, args, generator, bound: bool = True) -> dict:
    """Decode ``group`` samples from ``state``; per-step time, bytes read per step, bandwidth."""
    elapsed = []
    _reset_peak()
    _sync()
    rollouts = generate_from_state(model, state, group, args.new_tokens, temperature=args.temperature,
                                   eos_id=None, generator=generator, progress=lambda p: elapsed.append(p.elapsed_s),
                                   cuda_graphs=args.decode_cuda_graphs)
    _sync()
    per_step = step_seconds(elapsed, args.warmup_steps)
    bytes_per_step = weight_bytes(model) + state.nbytes() + rollouts.decode_state_bytes
    bound_s = bytes_per_step / (args.hbm_tbps * 1e12) if bound else None
    return dict(group=group, cuda_graphs=rollouts.cuda_graphs, per_step_s=per_step, tokens_per_s=group / per_step,
                total_s=rollouts.seconds,
                bytes_per_step=bytes_per_step, reads_everything=bound, bandwidth_bound_s=bound_s,
                bandwidth_fraction=bound_s / per_step if bound else None,
                decode_state_gib=rollouts.decode_state_bytes / GiB, peak_gib=_peak_gib(),
                tokens=[r.tolist() for r in rollouts.responses] if args.temperature == 0 else None)


def hf_model_like(hf: dict, model, folder: str):
    """transformers' model of ``hf`` holding ``model``'s weights: converted by the family's
    ``mcore_to_hf``, written to ``folder`` and read back with ``from_pretrained`` (as an exported
    checkpoint is), in the model's dtype and on its device, with SDPA attention."""
    import json

    from safetensors.torch import save_file

    from megatron_longstraw.testing.hf_reference import hf_model_class

    family = family_for(hf["model_type"])
    weights = {n: t.detach() for n, t in model.state_dict().items() if not n.endswith("_extra_state")}
    tensors = family.weights.mcore_to_hf(weights, hf, checkpoint_layout=True)
    config = family.hf_output_config(hf)
    Path(folder).mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(Path(folder) / "model.safetensors"))
    (Path(folder) / "config.json").write_text(json.dumps(config))
    model_cls, _ = hf_model_class(config["model_type"])  # torch kernels where there is no GPU
    dtype = next(model.parameters()).dtype
    try:
        reference = model_cls.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    except (ValueError, ImportError):  # a model without SDPA keeps eager attention
        reference = model_cls.from_pretrained(folder, dtype=dtype)
    return reference.to(device()).eval()


class StepClock:
    """A transformers logits processor that only records when each decode step's logits arrive
    (the GPU synchronized first): the first after the prefill, then one per further token."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        _sync()
        self.times.append(time.perf_counter())
        return scores


def theirs(reference, prompt_ids_P: torch.Tensor, group: int, args) -> dict:
    """transformers' ``generate`` of ``group`` samples, or its out-of-memory: the wall time, the
    prefill (to the first step's logits) and the per-step time after ``--warmup-steps`` steps, all
    from one call (``StepClock``). Its kernels were warmed up on a short prompt first."""
    from transformers import LogitsProcessorList

    options = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0,
                   do_sample=args.temperature > 0)
    if args.temperature > 0:
        options.update(temperature=args.temperature, top_k=0, top_p=1.0)

    def generate(ids_P, clock=None):
        inputs = dict(input_ids=ids_P[None].expand(group, -1).contiguous(),  # G copies, as sampling G does
                      attention_mask=torch.ones(group, ids_P.numel(), dtype=torch.long, device=ids_P.device))
        processors = LogitsProcessorList([clock]) if clock is not None else None
        return reference.generate(**inputs, **options, logits_processor=processors)

    out = dict(group=group)
    clock = StepClock()
    _reset_peak()
    try:
        with torch.no_grad():
            generate(prompt_ids_P[: min(prompt_ids_P.numel(), 1024)])  # kernels compiled and tuned here
            _reset_peak()
            _sync()
            start = time.perf_counter()
            tokens = generate(prompt_ids_P, clock)
            _sync()
            total = time.perf_counter() - start
    except torch.OutOfMemoryError:
        out.update(oom=True, peak_gib=_peak_gib())
        return out
    elapsed = [t - start for t in clock.times]
    out.update(total_s=total, prefill_s=elapsed[0],
               # step k's logits come after k forwards past the prefill's: the steady time per forward
               per_step_s=step_seconds([t - elapsed[0] for t in elapsed[1:]], args.warmup_steps),  peak_gib=_peak_gib(),
               tokens=tokens[:, prompt_ids_P.numel():].tolist() if args.temperature == 0 else None)
    return out


def profile_decode(model, state, group: int, args, generator, path) -> None:
    """A torch profiler's tables of ``group`` samples decoding ``--new-tokens`` tokens (by self GPU
    time and by CPU time, per operator) written to ``path``: where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        generate_from_state(model, state, group, args.new_tokens, temperature=args.temperature, eos_id=None,
                            generator=generator, cuda_graphs=args.decode_cuda_graphs)
        _sync()
    table = prof.key_averages()
    by_device = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    path.write_text(f"{group} samples, {args.new_tokens} tokens\n\nby self device time:\n"
                    + table.table(sort_by=by_device, row_limit=30)
                    + "\n\nby CPU time (with children):\n" + table.table(sort_by="cpu_time_total", row_limit=30))


def _name(args) -> str:
    """The model as the results name it."""
    return cli.group_from(args, ModelConfig).name


def run(args) -> list[dict]:
    hf = model_hf_config(cli.group_from(args, ModelConfig))
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    kernels = cli.group_from(args, KernelOptions)
    model = build_model(hf, ModelOptions(params_dtype=dtype, kernel_options=kernels)).eval()
    scratch = tempfile.TemporaryDirectory()
    reference = hf_model_like(hf, model, scratch.name) if args.hf_group_sizes else None
    generator = torch.Generator(device=device()).manual_seed(0)
    results = []
    for length in args.prompt_lengths:
        prompt_ids_P = torch.randint(0, hf["vocab_size"], (length,), device=device(),
                                     generator=torch.Generator(device=device()).manual_seed(length))
        _sync()
        start = time.perf_counter()
        with torch.no_grad():
            state = capture_prompt(model, prompt_ids_P[None], args.prompt_chunk_size)
        _sync()
        point = dict(prompt_length=length, capture_s=time.perf_counter() - start, state_gib=state.nbytes() / GiB,
                     weights_gib=weight_bytes(model) / GiB, ours=[], hf=[])
        try:
            for group in args.group_sizes:
                point["ours"].append(ours(model, state, group, args, generator, bound=reads_everything(hf)))
            if args.profile:
                Path(args.output_dir).mkdir(parents=True, exist_ok=True)
                profile_decode(model, state, args.profile, args, generator,
                               Path(args.output_dir) / f"{bench_stem('decode', _name(args), args.tag)}_profile_{length}.txt")
        finally:
            state.free()
        for group in args.hf_group_sizes:
            point["hf"].append(theirs(reference, prompt_ids_P, group, args))
        if args.temperature == 0:  # greedy: the same tokens, where both ran the same G
            mine = {r["group"]: r["tokens"] for r in point["ours"]}
            for r in point["hf"]:
                if not r.get("oom") and r["group"] in mine:
                    r["tokens_match"] = r["tokens"] == mine[r["group"]]
        results.append(point)
        print(_lines(results[-1:], args)[-1], flush=True)
    scratch.cleanup()
    return results


def _lines(results, args) -> list[str]:
    rows = []
    for point in results:
        for r in point["ours"]:
            bound = (f"{r['bandwidth_bound_s'] * 1e3:.2f} | {r['bandwidth_fraction']:.0%}" if r["bandwidth_bound_s"]
                     else "(sparse reads: no bound) | ")
            read = f"{r['bytes_per_step'] / GiB:.2f}" + ("" if r["reads_everything"] else " (at most)")
            rows.append(f"| {point['prompt_length']:,} | {r['group']} | {r['per_step_s'] * 1e3:.2f} | {r['tokens_per_s']:,.0f} "
                        f"| {read} | {bound} | {'' if r['peak_gib'] is None else f'{r['peak_gib']:.1f}'} |")
    return rows


def write(results, args, command) -> None:
    lines = [f"# Decode benchmark: {_name(args)}", "", f"Command: `{command}`", "",
             f"{args.new_tokens} tokens per sample, per-step time after {args.warmup_steps} steps, "
             f"bandwidth bound at {args.hbm_tbps} TB/s; our decode steps "
             + ("replayed from CUDA graphs." if any(r["cuda_graphs"] for p in results for r in p["ours"])
                else "run eagerly (no CUDA graphs)."), "",
             "| prompt | G | ms / step | tokens/s | GiB read / step | bound ms / step | of bandwidth | peak GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |", *_lines(results, args)]
    hf_rows = [(p, r) for p in results for r in p["hf"]]
    if hf_rows:
        lines += ["", "transformers `generate`, same weights, prompt and G (prefill included in its wall time):", "",
                  "| prompt | G | wall s | prefill s | ms / step (steady) | peak GiB | greedy tokens equal ours |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for p, r in hf_rows:
            if r.get("oom"):
                lines.append(f"| {p['prompt_length']:,} | {r['group']} | out of memory | | | "
                             f"{'' if r['peak_gib'] is None else f'>{r['peak_gib']:.1f}'} | |")
                continue
            step = f"{r['per_step_s'] * 1e3:.2f}"
            lines.append(f"| {p['prompt_length']:,} | {r['group']} | {r['total_s']:.2f} | {r['prefill_s']:.2f} "
                         f"| {step} | {'' if r['peak_gib'] is None else f'{r['peak_gib']:.1f}'} "
                         f"| {r.get('tokens_match', '')} |")
    write_bench_files(args.output_dir, bench_stem("decode", _name(args), args.tag), dict(command=command, results=results),
                      lines)


def main(argv=None):
    args = parse_args(argv)
    command = command_line(argv)
    init_distributed(ParallelSizes(), seed=1234)
    try:
        results = run(args)
    finally:
        destroy_distributed()
    write(results, args, command)
    return results


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        raise SystemExit(f"error: {err}")
