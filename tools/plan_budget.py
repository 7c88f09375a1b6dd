#!/usr/bin/env python3
"""Does a LongStraw GRPO run fit on these GPUs, with which layout, and how long will a step take?

    python tools/plan_budget.py --model qwen3.6-27b --num-gpus 8 --gpu h200 \
        --prompt-length 2088960 --response-length 8192 --num-generations 8
    python tools/plan_budget.py --model qwen3.5-0.8b --num-gpus 1 --gpu h200 \
        --prompt-gradient exact --max-prompt --max-step-seconds 600

Prints every valid layout (TP, CP, PP, virtual stages, EP, DP) with its predicted per-GPU peak by
part and its step time by phase, marks the fastest that fits; ``--max-prompt`` finds the largest
prompt some layout fits; ``--json`` writes the same for tools. Library: ``megatron_longstraw.planning``.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_longstraw import console  # noqa: E402

console.quiet_third_party()  # before torch and Megatron load

from megatron_longstraw.planning.report import add_plan_arguments, plan_from_args, render_table  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_arguments(parser)
    g = parser.add_argument_group("output")
    g.add_argument("--max-prompt", action="store_true",
                   help="find the largest prompt (multiple of 1,024 tokens) some layout fits")
    g.add_argument("--max-step-seconds", type=float, default=None,
                   help="with --max-prompt: the step must also end within this many seconds")
    g.add_argument("--json", action="store_true", help="print the plans as JSON instead of a table")
    g.add_argument("--top", type=int, default=0, help="show only the first N layouts (0: all)")
    g.add_argument("--against", metavar="DIR", default=None,
                   help="instead: every benchmark run in DIR (bench_*.json) beside its plan, as a markdown table")
    g.add_argument("--fit-rates", metavar="DIR", default=None,
                   help="instead: the kernel rates of planning/kernels.py read off DIR's runs by least squares")
    args = parser.parse_args(argv)
    try:
        if args.max_step_seconds is not None and (not args.max_prompt or args.max_step_seconds <= 0):
            raise ValueError("--max-step-seconds needs --max-prompt and a positive number of seconds")
        if args.top < 0:
            raise ValueError(f"--top {args.top}: must be 0 (all) or more")
        if args.fit_rates:
            from megatron_longstraw.planning import kernels
            from megatron_longstraw.planning.calibration import fit_rates

            print("| constant | fitted | planning/kernels.py |\n| --- | --- | --- |")
            for name, value in fit_rates(args.fit_rates).items():
                print(f"| `{name}` | {value:.4g} | {getattr(kernels, name):.4g} |")
            return 0
        if args.against:
            from megatron_longstraw.planning.measured import comparison_table

            print(comparison_table(args.against))
            return 0
        request = plan_from_args(args)
        if args.max_prompt:
            from megatron_longstraw.planning.planner import max_prompt

            length, plan = max_prompt(request.profile, request.run, request.gpu, request.num_gpus,
                                      max_step_seconds=args.max_step_seconds, hf=request.hf,
                                      chunk_sizes=request.chunk_sizes, recompute=request.recompute, **request.fixed)
            result = dict(model=request.profile.name, gpu=request.gpu.name, num_gpus=request.num_gpus,
                          prompt_gradient=request.run.prompt_gradient, max_step_seconds=args.max_step_seconds,
                          largest_prompt=length, plan=plan.as_dict() if plan else None)
            if args.json:
                print(json.dumps(result, indent=1))
            else:
                limit = f" and a step within {args.max_step_seconds:g} s" if args.max_step_seconds else ""
                print(f"largest prompt with {request.profile.name} on {request.num_gpus} x {request.gpu.name} "
                      f"({request.run.prompt_gradient}{limit}): {length:,} tokens")
                if plan:
                    print("  " + plan.line())
            return 0 if plan else 1
        plans = request.plans()
        if args.json:
            print(json.dumps(dict(model=request.profile.name, gpu=request.gpu.name, num_gpus=request.num_gpus,
                                  run=request.run.__dict__, plans=[p.as_dict() for p in plans]), indent=1))
        else:
            print(render_table(request, plans[: args.top] if args.top else plans))
        return 0 if any(p.fits for p in plans) else 1
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
