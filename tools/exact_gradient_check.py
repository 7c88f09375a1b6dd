"""Exact prompt gradients at scale: ``--prompt-gradient exact`` against the full graph, and what
the detached state drops.

On one GPU, for a preset with random weights, one prompt and G responses, three gradients of the
same loss (``-sum(logprobs) / response tokens``) from zero: the full graph with nothing detached
(``full_graph_responses(..., exact=True)``, the reference), LongStraw's exact mode (capture with
chunk starts, replay with state gradients, the reverse sweep over the prompt) and LongStraw's
detached mode. Reports the cosine of exact and of detached against the full graph over the whole
model and per parameter tensor whose reference norm is at least ``--norm-floor`` times the
largest tensor's, and the cosine between detached and exact; writes JSON and a markdown table
with the command into ``--output-dir``.

Example (GPU host):
    python tools/exact_gradient_check.py --model qwen3.5-0.8b --prompt-length 32768 \\
        --group-size 2 --response-length 8192 --prompt-chunk-size 8192 --seed 0 --output-dir docs/bench
"""

import argparse
import sys
import time

from megatron_longstraw.config import cli
from megatron_longstraw.config.benchmark import BenchOutputConfig
from megatron_longstraw.config.longstraw import LongStrawConfig
from megatron_longstraw.config.model import ModelConfig
from megatron_longstraw.config.parallel import ParallelSizes
from megatron_longstraw.config.training import TrainingConfig
from megatron_longstraw.config.workload import WorkloadConfig


def build_parser() -> argparse.ArgumentParser:
    """The tool's flags: the shared ones from the configuration (``config/``), its own below."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_flags(p, ModelConfig, only=("model", "num_layers"))
    cli.add_flags(p, WorkloadConfig, only=("prompt_length", "response_length"))
    cli.add_flags(p, LongStrawConfig, only=("prompt_chunk_size",))
    cli.add_flags(p, TrainingConfig, only=("seed",))
    cli.add_flags(p, BenchOutputConfig)
    g = p.add_argument_group("gradient check")
    g.add_argument("--group-size", type=int, default=2, help="responses per prompt (G) (default: 2)")
    g.add_argument("--norm-floor", type=float, default=1e-3,
                   help="per-tensor cosines count tensors whose full-graph gradient norm is at least this "
                        "fraction of the largest tensor's (default: 0.001)")
    return p


if __name__ == "__main__":
    build_parser().parse_args()  # --help and a bad flag answer before torch and Megatron load

import torch  # noqa: E402

from megatron_longstraw.checkpointing.model_checkpoint import model_hf_config  # noqa: E402
from megatron_longstraw.distributed import destroy_distributed, device, init_distributed  # noqa: E402
from megatron_longstraw.longstraw.capture import capture_prompt  # noqa: E402
from megatron_longstraw.longstraw.full_graph import full_graph_responses  # noqa: E402
from megatron_longstraw.longstraw.prompt_backward import check_prompt_gradient_support  # noqa: E402
from megatron_longstraw.longstraw.replay import replay_responses  # noqa: E402
from megatron_longstraw.models.builder import build_stage_model  # noqa: E402
from megatron_longstraw.models.options import ModelOptions  # noqa: E402
from megatron_longstraw.testing.parity import exact_gradients  # noqa: E402
from bench_output import bench_stem, command_line, write_bench_files  # noqa: E402 (tools/, beside this script)


def parse_args(argv=None) -> argparse.Namespace:
    """The tool's flags, the shared ones checked by their configuration groups."""
    args = build_parser().parse_args(argv)
    for group in (ModelConfig, WorkloadConfig, LongStrawConfig, TrainingConfig):
        cli.group_from(args, group)
    if args.group_size < 1:
        raise ValueError(f"--group-size must be at least 1, got {args.group_size}")
    return args


def _grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as fp32 (zeros where none arrived), gradients reset."""
    out = {n: (p.grad.float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32))
           for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two gradients (float64 accumulation); 0 when either is zero."""
    a, b = a.double().flatten(), b.double().flatten()
    denom = a.norm() * b.norm()
    return (a @ b / denom).item() if denom > 0 else 0.0


def compare(got: dict, want: dict, norm_floor: float) -> dict:
    """Whole-model cosine of ``got`` against ``want`` and per tensor where ``want``'s norm is at
    least ``norm_floor`` times the largest tensor norm: the worst such cosine and its tensor."""
    names = sorted(want)
    whole = cosine(torch.cat([got[n].flatten() for n in names]), torch.cat([want[n].flatten() for n in names]))
    norms = {n: want[n].norm().item() for n in names}
    floor = norm_floor * max(norms.values())
    per = {n: cosine(got[n], want[n]) for n in names if norms[n] >= floor}
    worst = min(per, key=per.get)
    return dict(whole=whole, tensors=len(per), of=len(names), worst=per[worst], worst_name=worst,
                below_0_99=sorted(n for n, c in per.items() if c < 0.99))


def main(argv=None):
    args = parse_args(argv)
    command = command_line(argv)
    init_distributed(ParallelSizes(), seed=1234 + args.seed)
    try:
        model_config = cli.group_from(args, ModelConfig)
        hf = model_hf_config(model_config)
        hf["max_position_embeddings"] = max(hf.get("max_position_embeddings", 0),
                                            args.prompt_length + args.response_length)
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        model = build_stage_model(hf, ModelOptions(params_dtype=dtype))
        check_prompt_gradient_support(model)
        gen = torch.Generator(device=device()).manual_seed(args.seed)
        prompt = torch.randint(0, hf["vocab_size"], (1, args.prompt_length), device=device(), generator=gen)
        responses = [torch.randint(0, hf["vocab_size"], (args.response_length,), device=device(), generator=gen)
                     for _ in range(args.group_size)]
        tokens = args.group_size * args.response_length

        def loss_fn(logprobs_RB, mask_RB, indices):
            return -(logprobs_RB * mask_RB).sum() / tokens

        times = {}
        t0 = time.perf_counter()
        full_graph_responses(model, prompt, responses, loss_fn, micro_batch_size=1, exact=True)
        full = _grads(model)
        times["full_graph_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        exact_gradients(model, prompt, responses, loss_fn, args.prompt_chunk_size)
        exact = _grads(model)
        times["exact_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.no_grad():
            state = capture_prompt(model, prompt, args.prompt_chunk_size)
        replay_responses(model, state, responses, loss_fn, 1)
        state.free()
        detached = _grads(model)
        times["detached_s"] = time.perf_counter() - t0
        result = dict(model=model_config.name, prompt_length=args.prompt_length, group=args.group_size,
                      response_length=args.response_length, chunk=args.prompt_chunk_size, dtype=str(dtype),
                      exact_vs_full=compare(exact, full, args.norm_floor),
                      detached_vs_full=compare(detached, full, args.norm_floor),
                      detached_vs_exact=compare(detached, exact, args.norm_floor), **times)
    finally:
        destroy_distributed()
    rows = [("exact vs full graph", result["exact_vs_full"]), ("detached vs full graph", result["detached_vs_full"]),
            ("detached vs exact", result["detached_vs_exact"])]
    lines = [f"# Exact prompt gradients against the full graph: {model_config.name}", "", f"Command: `{command}`", "",
             f"Prompt {args.prompt_length:,} tokens, G = {args.group_size} responses of {args.response_length:,}, "
             f"chunks of {args.prompt_chunk_size:,}, {dtype}, random weights. Per-tensor cosines over the tensors "
             f"whose full-graph gradient norm is at least {args.norm_floor:g} of the largest.", "",
             "| gradients | cosine, whole model | tensors counted | worst tensor cosine | worst tensor | tensors below 0.99 |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {label} | {c['whole']:.5f} | {c['tensors']} / {c['of']} | {c['worst']:.5f} | `{c['worst_name']}` "
              f"| {len(c['below_0_99'])} |" for label, c in rows]
    lines += ["", f"Times (s): full graph {result['full_graph_s']:.1f}, exact {result['exact_s']:.1f}, "
              f"detached {result['detached_s']:.1f} (the first includes kernel compilation)."]
    out = write_bench_files(args.output_dir, bench_stem("exact_gradient", model_config.name, args.tag),
                            dict(command=command, result=result), lines)
    print("\n".join(lines))
    print(f"written to {out}")


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        raise SystemExit(f"error: {err}")
