"""GRPO on LongStraw: capture each prompt once, sample G responses from its state, replay each
response with autograd against the detached state, step the optimizer.

    python train_grpo.py                    # embedded demo: tiny hybrid model, synthetic task
    torchrun --nproc-per-node 8 train_grpo.py --model qwen3.6-27b ...   (see examples/)

Flags follow Megatron's names (``python train_grpo.py --help``).
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from megatron_longstraw.distributed import destroy_distributed, device, init_distributed  # noqa: E402
from megatron_longstraw.grpo.registry import get_policy_loss  # noqa: E402
from megatron_longstraw.training.arguments import parse_args  # noqa: E402
from megatron_longstraw.training.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from megatron_longstraw.training.grpo_step import PhaseClock, train_group  # noqa: E402
from megatron_longstraw.training.metrics import reduce_step_metrics, throughput_metrics  # noqa: E402
from megatron_longstraw.training.optimizer import (  # noqa: E402
    build_optimizer, build_scheduler, finish_gradients, wrap_ddp)
from megatron_longstraw.training.run_logger import RunLogger  # noqa: E402
from megatron_longstraw.training.setup import build_policy, build_prompt_source, build_reward_fn  # noqa: E402


def train(args):
    """Run ``args.train_iters`` optimizer steps; returns the last step's metrics and the model."""
    hf, model, reference, tokenizer = build_policy(args)
    ddp = wrap_ddp(model, args)
    optimizer = build_optimizer(ddp, args)
    scheduler = build_scheduler(optimizer, args)
    source = build_prompt_source(args, hf, tokenizer)
    reward_fn = build_reward_fn(args, tokenizer)
    iteration, trainer_state = 0, {}
    if args.load:
        restored = load_checkpoint(args.load, model, optimizer, scheduler, reference)
        iteration, trainer_state = restored["iteration"], restored["trainer"]
        source.load_state_dict(trainer_state["data"])
    logger = RunLogger(args, {k: v for k, v in vars(args).items() if k != "parallel"},
                       run_id=trainer_state.get("wandb_run_id"), resume_step=iteration)
    generator = torch.Generator(device=device())  # sampling; reseeded per step so resumes are exact
    dp_rank = parallel_state.get_data_parallel_rank()
    groups_per_rank = args.global_batch_size // args.data_parallel_size
    policy_loss = get_policy_loss(args.loss_type)
    metrics = {}
    try:
        while iteration < args.train_iters:
            start, clock = time.perf_counter(), PhaseClock()
            generator.manual_seed(hash((args.seed, iteration, dp_rank)) % 2 ** 63)  # same on TP ranks
            for chunk in ddp:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            groups = [train_group(model, source.next_group(), args, reward_fn=reward_fn, eos_id=tokenizer.eos_id,
                                  generator=generator, groups_per_rank=groups_per_rank, reference=reference,
                                  clock=clock) for _ in range(groups_per_rank)]
            metrics = reduce_step_metrics(groups, policy_loss.summed_metrics)
            gradient_scale = policy_loss.finish_step(metrics, args)  # the loss's end-of-step normalizer
            if gradient_scale != 1.0:
                for chunk in ddp:
                    chunk.scale_gradients(gradient_scale)
            lr = scheduler.get_lr(optimizer.param_groups[0])
            with clock("optimizer"):
                finish_gradients(ddp)
                update_ok, grad_norm, _ = optimizer.step()
                if update_ok:
                    scheduler.step(increment=1)
            iteration += 1
            metrics.update(clock.metrics)
            metrics.update(throughput_metrics(hf, model, groups, clock.metrics, args))
            metrics.update({"optim/grad_norm": grad_norm if grad_norm is not None else float("nan"),
                            "optim/lr": lr, "optim/update_ok": float(update_ok),
                            "time/step_s": time.perf_counter() - start})
            if torch.cuda.is_available():
                metrics["mem/peak_gib"] = max(v for k, v in clock.metrics.items() if k.startswith("mem/"))
            logger.log(iteration, metrics)
            if not args.no_save and (iteration == args.train_iters or
                                     (args.save_interval and iteration % args.save_interval == 0)):
                state = {"data": source.state_dict(), "wandb_run_id": logger.run_id}
                save_checkpoint(args.save, iteration, model, optimizer, scheduler, state, hf, reference)
    finally:
        logger.finish()
    return metrics, model


def main(argv=None) -> None:
    """Parse, set up the process groups, train, tear down."""
    args = parse_args(argv, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    init_distributed(args.parallel, seed=args.seed)
    try:
        train(args)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
