#!/usr/bin/env python3
"""Does a LongStraw GRPO run fit on these GPUs, with which layout, and how long will a step take?

    python tools/plan_budget.py --model qwen3.6-27b --num-gpus 8 --gpu h200 --prompt-length 2088960 \
        --response-length 8192 --num-generations 8 --global-batch-size 1
    python tools/plan_budget.py --model qwen3.5-0.8b --num-gpus 1 --gpu h200 --num-generations 8 \
        --global-batch-size 1 --prompt-gradient exact --max-prompt --max-step-seconds 600

Prints every valid layout (TP, CP, PP, virtual stages, EP, DP) with its predicted per-GPU peak by
part and its step time by phase, marks the fastest that fits; ``--max-prompt`` finds the largest
prompt some layout fits; ``--json`` writes the same for tools. It takes the trainer's flags that
shape a step, with the trainer's defaults (a launch's flags plan that launch); the layout sizes,
``--prompt-chunk-size`` and ``--recompute-granularity`` it is not given it searches. Library:
``megatron_longstraw.planning``.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_longstraw import console  # noqa: E402

console.quiet_third_party()  # before torch and Megatron load

from megatron_longstraw.config import cli  # noqa: E402
from megatron_longstraw.config.planner import PlannerConfig  # noqa: E402


def build_parser():
    """The planner's command line (``config/planner.py``): the trainer's flags that shape a step,
    the GPUs, and what to answer."""
    return cli.build_parser(PlannerConfig, description=__doc__)


def main(argv=None) -> int:
    parser = build_parser()
    try:
        config, given = cli.parse(PlannerConfig, argv, parser)
        query = config.query
        if query.fit_rates:
            from megatron_longstraw.planning import kernels
            from megatron_longstraw.planning.calibration import fit_rates

            print("| constant | fitted | planning/kernels.py |\n| --- | --- | --- |")
            for name, value in fit_rates(query.fit_rates).items():
                print(f"| `{name}` | {value:.4g} | {getattr(kernels, name):.4g} |")
            return 0
        if query.against:
            from megatron_longstraw.planning.measured import comparison_table

            print(comparison_table(query.against))
            return 0
        from megatron_longstraw.checkpointing.model_checkpoint import model_hf_config
        from megatron_longstraw.models.registry import use_family
        from megatron_longstraw.planning.report import plan_request, render_table

        if config.model.model_family:
            use_family(config.model.model_family)
        request = plan_request(config, given, model_hf_config(config.model))
        if query.max_prompt:
            from megatron_longstraw.planning.planner import max_prompt

            length, plan = max_prompt(request.profile, request.run, request.gpu, request.num_gpus,
                                      max_step_seconds=query.max_step_seconds, hf=request.hf,
                                      chunk_sizes=request.chunk_sizes, recompute=request.recompute, **request.fixed)
            result = dict(model=request.profile.name, gpu=request.gpu.name, num_gpus=request.num_gpus,
                          prompt_gradient=request.run.prompt_gradient, max_step_seconds=query.max_step_seconds,
                          largest_prompt=length, plan=plan.as_dict() if plan else None)
            if query.json:
                print(json.dumps(result, indent=1))
            else:
                limit = f" and a step within {query.max_step_seconds:g} s" if query.max_step_seconds else ""
                print(f"largest prompt with {request.profile.name} on {request.num_gpus} x {request.gpu.name} "
                      f"({request.run.prompt_gradient}{limit}): {length:,} tokens")
                if plan:
                    print("  " + plan.line())
            return 0 if plan else 1
        plans = request.plans()
        if query.json:
            print(json.dumps(dict(model=request.profile.name, gpu=request.gpu.name, num_gpus=request.num_gpus,
                                  run=request.run.__dict__, plans=[p.as_dict() for p in plans]), indent=1))
        else:
            print(render_table(request, plans[: query.top] if query.top else plans))
        return 0 if any(p.fits for p in plans) else 1
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
