"""Benchmark LongStraw (capture + replay) against the full-graph baseline: memory and time.

For a preset and lists of prompt lengths and group sizes, measures peak allocated memory and
time per phase (capture, each replay, optimizer step) for ``--modes longstraw,full``, predicts the
memory floor (parameters + gradients + AdamW states + the prompt state, all by formula, plus
the bytes autograd keeps for one replayed micro-batch, counted with saved-tensor hooks), and writes JSON, a markdown table and a PNG plot (peak memory vs prompt
length for both modes, and vs G) into ``--output-dir``, each with the command that made it.

Example (GPU host):
    python tools/bench_longstraw.py --model qwen3.5-0.8b --prompt-lengths 131072,524288,1048576 \\
        --group-sizes 2,8 --response-length 8192 --modes longstraw,full --output-dir docs/bench
"""

import contextlib
import gc
import json
import sys
import time

from megatron_longstraw.config import cli
from megatron_longstraw.config.benchmark import BenchmarkConfig


def build_parser():
    """The benchmark's command line (``config/benchmark.py``'s ``BenchmarkConfig``)."""
    return cli.build_parser(BenchmarkConfig, description=__doc__)


def parse_args(argv=None) -> BenchmarkConfig:
    """The benchmark's configuration of the command line ``argv``."""
    return cli.parse(BenchmarkConfig, argv, build_parser())[0]


if __name__ == "__main__":
    build_parser().parse_args()  # --help and a bad flag answer before torch and Megatron load

import torch  # noqa: E402
from megatron_longstraw.checkpointing.model_checkpoint import model_hf_config  # noqa: E402
from megatron_longstraw.distributed import destroy_distributed, device, init_distributed  # noqa: E402
from megatron_longstraw.longstraw.activation_meter import SavedTensorMeter  # noqa: E402
from megatron_longstraw.longstraw.capture import capture_prompt  # noqa: E402
from megatron_longstraw.longstraw.cost_model import memory_floor_bytes, prompt_flops  # noqa: E402
from megatron_longstraw.longstraw.full_graph import full_graph_responses  # noqa: E402
from megatron_longstraw.longstraw.prompt_backward import check_prompt_gradient_support, prompt_backward  # noqa: E402
from megatron_longstraw.longstraw.replay import replay_responses  # noqa: E402
from megatron_longstraw.models.builder import build_stage_model  # noqa: E402
from megatron_longstraw.models.options import ModelOptions  # noqa: E402
from megatron_longstraw.planning.hardware import gib_of_gb  # noqa: E402
from megatron_longstraw.planning.measured import bench_plan  # noqa: E402
from megatron_longstraw.planning.planner import model_profile  # noqa: E402
from bench_output import bench_stem, command_line, write_bench_files  # noqa: E402 (tools/, beside this script)

PEAK_TFLOPS = 785.0  # measured bf16 matmul peak of the H200 host (docs/longstraw_benchmark.md)
GiB = 2 ** 30


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gib():
    return torch.cuda.max_memory_allocated() / GiB if torch.cuda.is_available() else float("nan")


def _cp_group():
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group() if parallel_state.get_context_parallel_world_size() > 1 else None


def _reduce_grads(model):
    """Average the gradients over the CP ranks, as Megatron's DDP does over DP x CP (each rank
    already holds the full gradient after replay; the all-reduce is the cost being measured)."""
    group = _cp_group()
    if group is not None:
        size = torch.distributed.get_world_size(group)
        for p in model.parameters():
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad, group=group)
                p.grad.div_(size)


def _max_over_ranks(value: float) -> float:
    """The largest ``value`` over the ranks (CP or PP; per-GPU peaks: the busiest GPU counts)."""
    if torch.distributed.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device())
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return tensor.item()


def _per_stage(value: float) -> list[float]:
    """``value`` of every pipeline stage, in stage order."""
    from megatron.core import parallel_state

    values = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    torch.distributed.all_gather_object(values, value, group=parallel_state.get_pipeline_model_parallel_group())
    return values


def _reset_peak():
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


@contextlib.contextmanager
def capture_split(model, hf, times: dict):
    """GLM-5: seconds spent in the DSA indexer top-k, the sparse MLA attention and the MoE layers
    (each timed between CUDA synchronizations, so the split costs a few syncs per layer and
    chunk) accumulate into ``times``; other families time nothing."""
    if hf["model_type"] != "glm_moe_dsa":
        yield
        return
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_longstraw.models.glm5 import layers as glm5_layers

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            _sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            _sync()
            times[name] = times.get(name, 0.0) + time.perf_counter() - t0
            return out
        return wrapper

    parts = {"index_topk_blockwise": "indexer", "cp_index_topk": "indexer",  # CP=1 and CP>1 paths
             "sparse_latent_attention": "sparse_attention", "cp_sparse_latent_attention": "sparse_attention"}
    originals = {n: getattr(glm5_layers, n) for n in parts}
    starts, hooks = {}, []

    def before_moe(module, args):
        _sync()
        starts[module] = time.perf_counter()

    def after_moe(module, args, output):
        _sync()
        times["moe"] = times.get("moe", 0.0) + time.perf_counter() - starts[module]

    for module in model.modules():
        if isinstance(module, MoELayer):
            hooks += [module.register_forward_pre_hook(before_moe), module.register_forward_hook(after_moe)]
    try:
        for name, part in parts.items():
            setattr(glm5_layers, name, timed(part, originals[name]))
        yield
    finally:
        for name, fn in originals.items():
            setattr(glm5_layers, name, fn)
        for hook in hooks:
            hook.remove()


def _optimizer(model):
    """AdamW with its states allocated up front, so they count in every peak."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=torch.cuda.is_available())
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(0.0, device=p.device), "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p)}
        p.grad = torch.zeros_like(p)
    return opt


def _loss_fn(total_tokens):
    return lambda logprobs_RB, mask_RB, indices: -(logprobs_RB * mask_RB).sum() / total_tokens


def _planned(hf, prompt_length, group, config: BenchmarkConfig) -> dict | None:
    """The budget planner's prediction for a LongStraw point (``planning/``, the formulas of
    ``tools/plan_budget.py``): peak and floor GiB, whether it fits (``--memory-limit-gb`` or
    the H200), capture, replay per response and sweep s."""
    profile = model_profile(hf)
    if profile is None:  # a family without plan_profile: nothing to predict
        return None
    parallel, longstraw = config.parallel, config.longstraw
    plan = bench_plan(profile, cp=parallel.context_parallel_size, pp=parallel.pipeline_model_parallel_size,
                      vpp=parallel.num_virtual_stages_per_pipeline_rank, prompt_length=prompt_length,
                      response_length=config.workload.response_length, group=group,
                      prompt_gradient=longstraw.prompt_gradient, chunk_size=longstraw.prompt_chunk_size,
                      micro_batch_size=longstraw.replay_micro_batch_size, memory_gib=_memory_limit_gib(config))
    return dict(peak_gib=plan.memory.peak, floor_gib=plan.memory.floor, fits=plan.fits, capture_s=plan.time.capture,
                replay_s=plan.time.replay / group, prompt_backward_s=plan.time.prompt_backward)


def _memory_limit_gib(config: BenchmarkConfig) -> float | None:
    """``--memory-limit-gb`` in GiB (``None``: the whole GPU)."""
    return gib_of_gb(config.bench.memory_limit_gb) if config.bench.memory_limit_gb is not None else None


def limit_memory(config: BenchmarkConfig) -> None:
    """Cap what this process's caching allocator may reserve at ``--memory-limit-gb``."""
    if config.bench.memory_limit_gb is None or not torch.cuda.is_available():
        return
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if config.bench.memory_limit_gb * 1e9 > total:
        raise ValueError(f"--memory-limit-gb {config.bench.memory_limit_gb}: more than the GPU's {total / 1e9:.1f} GB")
    torch.cuda.set_per_process_memory_fraction(config.bench.memory_limit_gb * 1e9 / total)


def run_point(model, optimizer, hf, mode, prompt_length, group, config: BenchmarkConfig):
    """One (mode, prompt length, G) point; returns a result dict (``oom`` on out of memory)."""
    gen = torch.Generator(device=device()).manual_seed(prompt_length + group)
    prompt = torch.randint(0, hf["vocab_size"], (1, prompt_length), device=device(), generator=gen)
    response_length, parallel, precision = config.workload.response_length, config.parallel, config.precision
    responses = [torch.randint(0, hf["vocab_size"], (response_length,), device=device(), generator=gen)
                 for _ in range(group)]
    loss_fn = _loss_fn(group * response_length)
    exact, peak_before_sweep = config.longstraw.exact, 0.0
    result = dict(mode=mode, prompt_gradient=config.longstraw.prompt_gradient, prompt_length=prompt_length, group=group,
                  response_length=response_length, context_parallel=parallel.context_parallel_size,
                  pipeline_parallel=parallel.pipeline_model_parallel_size,
                  virtual_stages=parallel.num_virtual_stages_per_pipeline_rank,
                  transformer_impl=config.model.transformer_impl,
                  fp8=f"{precision.fp8_format}/{precision.fp8_recipe}" if precision.fp8_format else None,
                  warmup_prompt_length=config.bench.warmup_prompt_length, memory_limit_gib=_memory_limit_gib(config))
    if mode == "longstraw" and config.model.transformer_impl == "local":
        result["planned"] = _planned(hf, prompt_length, group, config)
    _sync()
    if torch.cuda.is_available():  # what the earlier points left behind shows here
        result["allocated_at_start_gib"] = torch.cuda.memory_allocated() / GiB
    _reset_peak()
    start = time.perf_counter()
    try:
        if mode == "longstraw":
            split = {}
            with capture_split(model, hf, split):
                state = capture_prompt(model, prompt, config.longstraw.prompt_chunk_size, exact=exact)
            _sync()
            result["capture_s"] = time.perf_counter() - start
            if split:
                split["rest"] = result["capture_s"] - sum(split.values())
                result["capture_split_s"] = split
            result["capture_peak_gib"] = _peak_gib()
            result["state_gib"] = state.nbytes() / GiB
            flops = prompt_flops(hf, model, prompt_length) if parallel.pipeline_model_parallel_size == 1 else None
            if flops is not None:  # (per stage under PP: not counted)
                result["capture_tflops"] = flops / result["capture_s"] / 1e12
                result["capture_mfu"] = result["capture_tflops"] / (PEAK_TFLOPS * parallel.context_parallel_size)
            replay_times = []
            state_tensors = [t for layer in state.layers.values() for t in layer.tensors().values()]
            meter = SavedTensorMeter([*model.parameters(), *state_tensors, state.last_hidden_1BH])
            mbs = config.longstraw.replay_micro_batch_size
            # one micro-batch measured alone (its activations: the floor's term); under PP the rest
            # then go through the pipeline schedule in one call, per micro-batch time its mean
            batches = ([responses[i:i + mbs] for i in range(0, group, mbs)] if parallel.pipeline_model_parallel_size == 1
                       else [b for b in (responses[:mbs], responses[mbs:]) if b])
            for i, batch in enumerate(batches):
                t0 = time.perf_counter()
                with meter if i == 0 else contextlib.nullcontext():
                    replay_responses(model, state, batch, loss_fn, mbs, exact=exact)
                _sync()
                micro_batches = -(-len(batch) // mbs)
                replay_times += [(time.perf_counter() - t0) / micro_batches] * micro_batches
            result["replay_s"] = replay_times
            result["activation_gib"] = meter.nbytes / GiB
            if exact:  # the reverse sweep over the prompt, after every response's replay
                result["state_grad_gib"] = _max_over_ranks(state.state_grad_nbytes() / GiB)
                peak_before_sweep = _peak_gib()  # the step's peak is the larger of the two spans'
                _reset_peak()
                t0 = time.perf_counter()
                # the last chunk (the most earlier keys) metered: one chunk's recompute, the floor's term
                last_chunk = len(state.chunk_starts) - 1
                sweep_meter = SavedTensorMeter([*model.parameters(), *state_tensors, state.last_hidden_1BH])
                prompt_backward(model, state, prompt,
                                chunk_context=lambda i: sweep_meter if i == last_chunk else contextlib.nullcontext())
                _sync()
                result["sweep_activation_gib"] = sweep_meter.nbytes / GiB
                result["prompt_backward_s"] = time.perf_counter() - t0
                result["prompt_backward_peak_gib"] = _max_over_ranks(_peak_gib())
                result["prompt_backward_over_capture"] = result["prompt_backward_s"] / result["capture_s"]
                if flops is not None:  # model FLOPs of a forward recompute and its backward (2x)
                    result["prompt_backward_mfu"] = (3 * flops / result["prompt_backward_s"] / 1e12
                                                     / (PEAK_TFLOPS * parallel.context_parallel_size))
        else:
            replay_times = []
            for response in responses[: config.bench.full_max_group]:
                t0 = time.perf_counter()
                full_graph_responses(model, prompt, [response], loss_fn, exact=exact)
                _sync()
                replay_times.append(time.perf_counter() - t0)
            result["per_sample_s"] = replay_times
        t0 = time.perf_counter()
        _reduce_grads(model)  # what Megatron's DDP does over the DP x CP group before the step
        optimizer.step()
        _sync()
        result["optimizer_s"] = time.perf_counter() - t0
        result["step_s"] = time.perf_counter() - start
        peak = max(_peak_gib(), peak_before_sweep)
        result["peak_gib"] = _max_over_ranks(peak)
        if config.parallel.pipeline_model_parallel_size > 1:
            result["stage_peak_gib"] = _per_stage(peak)
        if torch.cuda.is_available():
            result["device_gib"] = torch.cuda.mem_get_info()[1] / GiB
        for key in ("capture_peak_gib", "state_gib"):
            if key in result:
                result[key] = _max_over_ranks(result[key])
        if mode == "longstraw":
            n_params = sum(p.numel() for p in model.parameters())
            dtype_bytes = next(model.parameters()).element_size()
            # exact: the state's gradient buffers too, and the larger of one micro-batch's replay
            # and one chunk's recompute (the two spans do not overlap)
            state_bytes = state.nbytes() + (state.state_grad_nbytes() if exact else 0)
            activation_bytes = max(meter.nbytes, sweep_meter.nbytes) if exact else meter.nbytes
            floor = memory_floor_bytes(n_params, dtype_bytes, 2 * dtype_bytes, state_bytes, activation_bytes) / GiB
            result["floor_activation_gib"] = _max_over_ranks(activation_bytes / GiB)
            result["floor_gib"] = _max_over_ranks(floor)  # per rank: this rank's (stage's) parameters
            result["peak_over_floor"] = _max_over_ranks(peak / floor)
            if config.parallel.pipeline_model_parallel_size > 1:
                result["stage_floor_gib"] = _per_stage(floor)
            state.free()
    except torch.OutOfMemoryError:
        result["oom"] = True
        result["peak_gib"] = _peak_gib()
    finally:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        gc.collect()  # what a point left in reference cycles goes before the next point's peak
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return result


def largest_prompt_fits(results) -> list[dict]:
    """Per (mode, CP, G) with peaks measured at two or more prompt lengths: the straight line
    through the first and the last, and where it reaches the device's memory."""
    groups = {}
    for r in results:
        if not r.get("oom") and r.get("device_gib") and r.get("peak_gib") == r.get("peak_gib"):
            groups.setdefault((r["mode"], r.get("context_parallel", 1), r.get("pipeline_parallel", 1), r["group"]),
                              []).append(r)
    fits = []
    for (mode, cp, pp, group), rows in sorted(groups.items()):
        rows = sorted(rows, key=lambda r: r["prompt_length"])
        if rows[-1]["prompt_length"] == rows[0]["prompt_length"]:
            continue
        slope = (rows[-1]["peak_gib"] - rows[0]["peak_gib"]) / (rows[-1]["prompt_length"] - rows[0]["prompt_length"])
        fixed = rows[0]["peak_gib"] - slope * rows[0]["prompt_length"]
        if slope <= 0:
            continue
        fits.append(dict(mode=mode, cp=cp, pp=pp, group=group, fixed_gib=fixed, per_1k_mib=slope * 1024 * 1024,
                         device_gib=_usable_gib(rows[0]),
                         largest_prompt=int((_usable_gib(rows[0]) - fixed) / slope)))
    return fits


def _usable_gib(result) -> float:
    """The memory a point could use: its ``--memory-limit-gb``, else the device's."""
    return result.get("memory_limit_gib") or result["device_gib"]


def _mean(values):
    return sum(values) / len(values) if values else None


def _cell(value, spec):
    """A table cell: blank where a mode has no such figure (the full graph has no capture)."""
    return "" if value is None or value != value else format(value, spec)


def write_outputs(results, config: BenchmarkConfig, command, quiet=False):
    stem = bench_stem("bench", config.model.name, config.output.tag)
    lines = [f"# LongStraw benchmark: {config.model.name}", "", f"Command: `{command}`", "",
             f"Prompt gradient: {config.longstraw.prompt_gradient}.", "",
             "| mode | CP | PP | prompt | G | capture s | capture MFU | replay s (mean) | prompt bwd s | per-sample s | step s | state GiB | state grad GiB | act GiB | peak GiB | floor GiB | peak/floor | planned peak GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if r.get("oom"):
            lines.append(f"| {r['mode']} | {r.get('context_parallel', 1)} | {r.get('pipeline_parallel', 1)} "
                         f"| {r['prompt_length']} | {r['group']} | OOM "
                         f"| | | | | | | | | >{r['peak_gib']:.1f} | | | {_cell((r.get('planned') or {}).get('peak_gib'), '.2f')} |")
            continue
        cells = [_cell(r.get("capture_s"), ".1f"), _cell(r.get("capture_mfu"), ".1%"),
                 _cell(_mean(r.get("replay_s")), ".2f"), _cell(r.get("prompt_backward_s"), ".2f"),
                 _cell(_mean(r.get("per_sample_s")), ".2f"), _cell(r["step_s"], ".1f"), _cell(r.get("state_gib"), ".2f"),
                 _cell(r.get("state_grad_gib"), ".2f"), _cell(r.get("activation_gib"), ".2f"),
                 _cell(r["peak_gib"], ".2f"), _cell(r.get("floor_gib"), ".2f"), _cell(r.get("peak_over_floor"), ".3f"),
                 _cell((r.get("planned") or {}).get("peak_gib"), ".2f")]
        lines.append(f"| {r['mode']} | {r.get('context_parallel', 1)} | {r.get('pipeline_parallel', 1)} "
                     f"| {r['prompt_length']} | {r['group']} | " + " | ".join(cells) + " |")
    fits = largest_prompt_fits(results)
    if fits:
        lines += ["", "Largest prompt per GPU memory, predicted from a straight line through the measured peaks",
                  "(peak = fixed + per-token x prompt; the position budget is not counted):", "",
                  "| mode | CP | PP | G | fixed GiB | MiB per 1K prompt tokens | device GiB | largest prompt |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {f['mode']} | {f['cp']} | {f['pp']} | {f['group']} | {f['fixed_gib']:.2f} | {f['per_1k_mib']:.2f} "
                  f"| {f['device_gib']:.1f} | {f['largest_prompt']:,} |" for f in fits]
    sweeps = [r for r in results if r.get("prompt_backward_s") is not None]
    if sweeps:
        lines += ["", "Prompt backward sweep (exact mode; MFU counts the recomputed forward and its backward",
                  "as 3x the capture's model FLOPs; act GiB: one chunk's saved activations, the last chunk's):", "",
                  "| prompt | G | sweep s | sweep / capture | sweep MFU | sweep act GiB | sweep peak GiB |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['prompt_length']} | {r['group']} | {r['prompt_backward_s']:.1f} "
                  f"| {r['prompt_backward_over_capture']:.2f} | {_cell(r.get('prompt_backward_mfu'), '.1%')} "
                  f"| {_cell(r.get('sweep_activation_gib'), '.2f')} | {_cell(r.get('prompt_backward_peak_gib'), '.2f')} |"
                  for r in sweeps]
    stages = [r for r in results if r.get("stage_peak_gib")]
    if stages:
        lines += ["", "Per pipeline stage (peak / floor GiB):", "",
                  "| prompt | G | " + " | ".join(f"stage {i}" for i in range(len(stages[0]["stage_peak_gib"]))) + " |",
                  "| --- | --- | " + " | ".join("---" for _ in stages[0]["stage_peak_gib"]) + " |"]
        lines += [f"| {r['prompt_length']} | {r['group']} | " + " | ".join(
            f"{peak:.2f} / {floor:.2f}" for peak, floor in zip(r["stage_peak_gib"], r.get("stage_floor_gib", [])))
            + " |" for r in stages]
    splits = [r for r in results if r.get("capture_split_s")]
    if splits:
        lines += ["", "Capture time split (s; each part timed between CUDA synchronizations):", "",
                  "| prompt | G | indexer top-k | sparse MLA | MoE | rest |", "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['prompt_length']} | {r['group']} | " + " | ".join(
            f"{r['capture_split_s'].get(k, 0.0):.2f}" for k in ("indexer", "sparse_attention", "moe", "rest")) + " |"
            for r in splits]
    out = write_bench_files(config.output.output_dir, stem, dict(command=command, results=results), lines)
    _plot(results, out / f"{stem}.png", command)
    if not quiet:
        print("\n".join(lines))


def _plot(results, path, command):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, marker in (("longstraw", "o"), ("full", "s")):
        pts = sorted((r["prompt_length"], r["peak_gib"]) for r in results
                     if r["mode"] == mode and not r.get("oom") and r["group"] == min(x["group"] for x in results))
        if pts:
            ax1.plot(*zip(*pts), marker=marker, label=mode)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("prompt tokens")
    ax1.set_ylabel("peak allocated (GiB)")
    ax1.set_title("peak memory vs prompt length")
    ax1.legend()
    for length in sorted({r["prompt_length"] for r in results if r["mode"] == "longstraw"}):
        pts = sorted((r["group"], r["peak_gib"]) for r in results
                     if r["mode"] == "longstraw" and r["prompt_length"] == length and not r.get("oom"))
        if pts:
            ax2.plot(*zip(*pts), marker="o", label=f"prompt {length}")
    ax2.set_xlabel("G (responses per prompt)")
    ax2.set_ylabel("peak allocated (GiB)")
    ax2.set_title("LongStraw peak memory vs G")
    ax2.legend()
    fig.suptitle(command, fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    config = parse_args(argv)
    command = command_line(argv)
    init_distributed(config.parallel.sizes, seed=1234)
    rank0 = torch.distributed.get_rank() == 0
    limit_memory(config)
    hf = model_hf_config(config.model)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    results = []
    try:
        for mode in config.bench.modes:
            options = ModelOptions.of(config.model, config.precision, kernels=config.kernels, params_dtype=dtype,
                                      recompute_granularity="full" if mode == "full" else None)
            model = build_stage_model(hf, options)
            if config.longstraw.exact and mode == "longstraw":
                check_prompt_gradient_support(model)
            optimizer = _optimizer(model)
            if config.bench.warmup_prompt_length:
                warm = run_point(model, optimizer, hf, mode, config.bench.warmup_prompt_length, 1, config)
                if rank0:
                    print(json.dumps(dict(warmup=True, **warm)), flush=True)
            for length in (config.workload.prompt_lengths if mode == "longstraw" else config.full_prompt_lengths):
                for group in (config.workload.group_sizes if mode == "longstraw" else [1]):
                    result = run_point(model, optimizer, hf, mode, length, group, config)
                    results.append(result)
                    if rank0:
                        print(json.dumps(result), flush=True)
                        write_outputs(results, config, command, quiet=True)  # partial results survive a kill
            del model, optimizer
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    finally:
        destroy_distributed()
    if results and rank0:
        write_outputs(results, config, command)


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        raise SystemExit(f"error: {err}")
