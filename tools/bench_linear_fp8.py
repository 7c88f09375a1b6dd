"""FP8 against bf16 on a model's linear layers alone (Transformer Engine, one GPU).

Builds the model with the Transformer Engine spec, collects the shape of every TE linear layer
(one entry per layer, so a shape counts as often as the model has it), and times ``te.Linear``
forward + backward on ``--tokens`` rows for each distinct shape in bf16 and inside Megatron's FP8
context for ``--fp8-format``/``--fp8-recipe``. Reports TFLOP/s per shape and the whole model's
linear time in both precisions (the FP8 target's ratio, "on the linear layers alone").

    python tools/bench_linear_fp8.py --model qwen3.5-0.8b --tokens 32768 --fp8-format hybrid --tag 0.8b
"""

import argparse
import sys
from collections import Counter

from megatron_longstraw.config import cli
from megatron_longstraw.config.benchmark import BenchOutputConfig, TimingConfig
from megatron_longstraw.config.model import ModelConfig, PrecisionConfig
from megatron_longstraw.config.parallel import ParallelSizes


def build_parser() -> argparse.ArgumentParser:
    """The tool's flags: the shared ones from the configuration (``config/``), its own below. One
    period of a model's layer pattern (``--num-layers``) keeps its mix of linear shapes at a
    fraction of its memory."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_flags(p, ModelConfig, only=("model", "num_layers"))
    cli.add_flags(p, PrecisionConfig, only=("fp8_format", "fp8_recipe"))
    cli.add_flags(p, BenchOutputConfig)
    g = p.add_argument_group("linear layers")
    g.add_argument("--tokens", type=int, default=32768, help="rows of each linear's input (default: 32768)")
    cli.add_flags(p, TimingConfig)
    return p


if __name__ == "__main__":
    build_parser().parse_args()  # --help and a bad flag answer before torch and Megatron load

import torch  # noqa: E402

from megatron_longstraw.checkpointing.model_checkpoint import model_hf_config  # noqa: E402
from megatron_longstraw.distributed import destroy_distributed, init_distributed  # noqa: E402
from megatron_longstraw.models.builder import build_model  # noqa: E402
from megatron_longstraw.models.options import ModelOptions, have_transformer_engine  # noqa: E402
from bench_output import bench_stem, command_line, write_bench_files  # noqa: E402 (tools/, beside this script)


def parse_args(argv=None) -> argparse.Namespace:
    """The tool's flags, the shared ones checked by their configuration groups."""
    args = build_parser().parse_args(argv)
    cli.group_from(args, ModelConfig)
    cli.group_from(args, PrecisionConfig)
    cli.group_from(args, TimingConfig)
    if not torch.cuda.is_available() or not have_transformer_engine():
        raise ValueError("tools/bench_linear_fp8.py needs a CUDA GPU and Transformer Engine")
    if args.fp8_format is None:
        raise ValueError("tools/bench_linear_fp8.py compares FP8 with bf16: give --fp8-format")
    if args.tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
    return args


def linear_shapes(model) -> Counter:
    """``{(in_features, out_features): count}`` over the model's Transformer Engine linear layers."""
    import transformer_engine.pytorch as te

    return Counter((m.in_features, m.out_features) for m in model.modules()
                   if isinstance(m, (te.Linear, te.LayerNormLinear)))


def time_linear(shape, tokens: int, repeats: int, context) -> float:
    """Seconds per forward + backward of a bias-free ``te.Linear`` of ``shape`` on ``tokens`` rows."""
    import transformer_engine.pytorch as te

    layer = te.Linear(*shape, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(tokens, shape[0], dtype=torch.bfloat16, device="cuda", requires_grad=True)
    for _ in range(3):
        with context():
            layer(x).sum().backward()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        with context():
            layer(x).sum().backward()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats / 1e3


def main(argv=None) -> None:
    import contextlib

    from megatron.core.fp8_utils import get_fp8_context

    args = parse_args(argv)
    command = command_line(argv)
    init_distributed(ParallelSizes(), seed=1234)
    try:
        model_config = cli.group_from(args, ModelConfig)
        hf = model_hf_config(model_config)
        model = build_model(hf, ModelOptions(params_dtype=torch.bfloat16, transformer_impl="transformer_engine",
                                             fp8_format=args.fp8_format, fp8_recipe=args.fp8_recipe))
        shapes, config = linear_shapes(model), model.config
        del model
        rows, totals = [], {"bf16": 0.0, "fp8": 0.0}
        for shape, count in sorted(shapes.items()):
            flops = 3 * 2 * args.tokens * shape[0] * shape[1]
            row = dict(in_features=shape[0], out_features=shape[1], count=count)
            for name, context in (("bf16", contextlib.nullcontext), ("fp8", lambda: get_fp8_context(config))):
                seconds = time_linear(shape, args.tokens, args.repeats, context)
                row[f"{name}_s"], row[f"{name}_tflops"] = seconds, flops / seconds / 1e12
                totals[name] += count * seconds
            rows.append(row)
    finally:
        destroy_distributed()
    speedup = totals["bf16"] / totals["fp8"]
    layers = f", first {hf['num_hidden_layers']} layers" if args.num_layers else ""
    lines = [f"# Linear layers of {model_config.name}{layers}: FP8 ({args.fp8_format}/{args.fp8_recipe}) vs bf16", "",
             f"Command: `{command}`", "", f"{args.tokens} rows per linear, forward + backward.", "",
             "| in | out | layers | bf16 TFLOP/s | FP8 TFLOP/s | speedup |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['in_features']} | {r['out_features']} | {r['count']} | {r['bf16_tflops']:.0f} | "
              f"{r['fp8_tflops']:.0f} | {r['bf16_s'] / r['fp8_s']:.2f} |" for r in rows]
    lines += ["", f"Whole model's linear layers: bf16 {totals['bf16'] * 1e3:.1f} ms, FP8 {totals['fp8'] * 1e3:.1f} ms "
              f"per {args.tokens} tokens: **{speedup:.2f}x**."]
    write_bench_files(args.output_dir, bench_stem("linear_fp8", model_config.name, args.tag),
                      dict(command=command, rows=rows, totals_s=totals, speedup=speedup), lines)
    print("\n".join(lines))


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        raise SystemExit(f"error: {err}")
