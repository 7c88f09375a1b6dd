"""The training loop of ``train_grpo.py``: ``--train-iters`` GRPO steps, each ``--global-batch-size``
prompt groups (``grpo_step.train_group``), the loss's end-of-step scale, Megatron's optimizer,
metrics and checkpoints. Imported after the arguments are parsed (``train_grpo.main``)."""

import json
import time
from pathlib import Path

import torch
from megatron.core import parallel_state

from megatron_longstraw.checkpointing.model_checkpoint import resolve_checkpoint_dir
from megatron_longstraw.distributed import device
from megatron_longstraw.grpo.registry import get_policy_loss
from megatron_longstraw.training.checkpoint import (
    checkpoint_iteration, load_checkpoint, run_assets, save_checkpoint, set_aside_tracker)
from megatron_longstraw.training.dynamic_sampling import fill_groups
from megatron_longstraw.training.evaluation import evaluate
from megatron_longstraw.training.grpo_step import PhaseClock, train_group
from megatron_longstraw.training.metrics import reduce_step_metrics, throughput_metrics
from megatron_longstraw.training.optimizer import build_optimizer, build_scheduler, finish_gradients, wrap_ddp
from megatron_longstraw.training.plan_check import check_plan
from megatron_longstraw.training.run_logger import RunLogger
from megatron_longstraw.training.setup import build_policy, build_prompt_source, build_reward_fn, policy_hf_config


def train(args):
    """Run ``args.train_iters`` optimizer steps; returns the last step's metrics and the model
    (``{}, None`` when the checkpoint to resume is already at ``--train-iters``: nothing is touched)."""
    rank0 = torch.distributed.get_rank() == 0
    done = checkpoint_iteration(args.load) if args.load else 0
    _same_on_every_rank(done, "the iteration to resume from")
    if args.load and not args.skip_train:
        if done >= args.train_iters:
            if rank0:
                print(f"nothing to do: {resolve_checkpoint_dir(args.load)} is at iteration {done}, "
                      f"--train-iters is {args.train_iters}", flush=True)
            return {}, None
    check_plan(args, policy_hf_config(args), rank0)  # before any weight is allocated
    hf, model, reference, tokenizer = build_policy(args)
    ddp = wrap_ddp(model, args)
    optimizer = build_optimizer(ddp, args)
    scheduler = build_scheduler(optimizer, args)
    source = build_prompt_source(args, hf, tokenizer)
    reward_fn = build_reward_fn(args, tokenizer, source)  # called once here: a broken reward fails now
    iteration, trainer_state = 0, {}
    assets = run_assets(args)  # what every save carries for export (tokenizer, generation config)
    if args.load:
        load_start = time.perf_counter()
        restored = load_checkpoint(args.load, model, optimizer, scheduler, reference)
        iteration, trainer_state = restored["iteration"], restored["trainer"]
        source.load_state_dict(trainer_state["data"])
        if rank0:
            auto = " (the latest in --save; --no-load starts fresh)" if args.load == args.save else ""
            print(f"resuming from {resolve_checkpoint_dir(args.load)} at iteration {iteration}{auto}, loaded in "
                  f"{time.perf_counter() - load_start:.1f} s", flush=True)
    if args.skip_train:
        return evaluate_checkpoint(model, source, args, reward_fn, tokenizer.eos_id, iteration, rank0), model
    logger = RunLogger(args, {k: v for k, v in vars(args).items() if k != "parallel"},
                       run_id=trainer_state.get("wandb_run_id"), resume_step=iteration)
    generator = torch.Generator(device=device())  # sampling; reseeded per step so resumes are exact
    dp_rank = parallel_state.get_data_parallel_rank()
    groups_per_rank = args.global_batch_size // args.data_parallel_size
    policy_loss = get_policy_loss(args.loss_type)
    metrics = {}
    began = time.monotonic()  # --exit-duration-in-mins counts from here
    try:
        while iteration < args.train_iters:
            start, clock = time.perf_counter(), PhaseClock()
            generator.manual_seed(hash((args.seed, iteration, dp_rank)) % 2 ** 63)  # same on TP ranks
            for chunk in ddp:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            if args.curriculum is not None:  # the curriculum: a function of the step alone
                source.set_prompt_length(args.curriculum.length_at(iteration))
            groups, sampling_metrics, dropped_work = fill_groups(
                source.next_group,
                lambda group, drop_uniform: train_group(
                    model, group, args, reward_fn=reward_fn, eos_id=tokenizer.eos_id, generator=generator,
                    groups_per_rank=groups_per_rank, reference=reference, clock=clock, drop_uniform=drop_uniform),
                groups_per_rank, args.dynamic_sampling_max_draws if args.dynamic_sampling else None)
            metrics = reduce_step_metrics(groups, policy_loss.summed_metrics)
            metrics.update(sampling_metrics)
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
            if iteration == 1 and args.overwrite and not args.no_save:  # a fresh run writes from now on
                set_aside_tracker(args.save)
            if args.curriculum is not None:
                metrics["curriculum/prompt_length"] = float(source.dataset.task.prompt_length)
            if args.eval_interval and iteration % args.eval_interval == 0:
                with clock("eval"):
                    metrics.update(evaluate(model, source.dataset.task, args.eval_lengths, args, reward_fn,
                                            tokenizer.eos_id, iteration))
            metrics.update(clock.metrics)
            metrics.update(throughput_metrics(hf, model, groups, clock.metrics, args, dropped=dropped_work))
            metrics.update({"optim/grad_norm": grad_norm if grad_norm is not None else float("nan"),
                            "optim/lr": lr, "optim/update_ok": float(update_ok),
                            "time/step_s": time.perf_counter() - start})
            if torch.cuda.is_available():
                metrics["mem/peak_gib"] = max(v for k, v in clock.metrics.items() if k.startswith("mem/"))
            out_of_time = _out_of_time(began, args.exit_duration_in_mins) and iteration < args.train_iters
            try:
                if not args.no_save and (iteration == args.train_iters or out_of_time or
                                         (args.save_interval and iteration % args.save_interval == 0)):
                    save_start = time.perf_counter()
                    state = {"data": source.state_dict(), "wandb_run_id": logger.run_id}
                    save_checkpoint(args.save, iteration, model, optimizer, scheduler, state, hf, reference, assets)
                    metrics["time/save_s"] = time.perf_counter() - save_start
            finally:  # the step's metrics, with its save's time; also when the save fails
                logger.log(iteration, metrics)
            if out_of_time:
                if rank0:
                    saved = ("no checkpoint (--no-save): nothing to resume" if args.no_save
                             else f"saved iteration {iteration}, the same command resumes")
                    print(f"stopping at iteration {iteration} of {args.train_iters}: --exit-duration-in-mins "
                          f"{args.exit_duration_in_mins:g} reached; {saved}", flush=True)
                break
    finally:
        logger.finish()
    return metrics, model


def evaluate_checkpoint(model, source, args, reward_fn, eos_id: int, iteration: int, rank0: bool) -> dict:
    """``--skip-train``: the held-out eval figures of the loaded weights at ``--eval-prompt-lengths``,
    printed as one JSON line and written (rank 0, atomically) to
    ``<--wandb-save-dir>/eval_iter_<iteration>.json``."""
    metrics = evaluate(model, source.dataset.task, args.eval_lengths, args, reward_fn, eos_id, iteration)
    if rank0:
        record = {"iteration": iteration, "eval_prompts": args.eval_prompts, "lengths": args.eval_lengths, **metrics}
        path = Path(args.wandb_save_dir) / f"eval_iter_{iteration:07d}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(record, indent=1) + "\n")
        partial.replace(path)
        print(json.dumps(record), flush=True)
    return metrics


def _out_of_time(began: float, minutes) -> bool:
    """Whether ``minutes`` have passed since ``began`` on any rank (every rank stops at the same
    step: the decision is all-reduced)."""
    if minutes is None:
        return False
    late = torch.tensor([int(time.monotonic() - began >= 60 * minutes)], device=device())
    torch.distributed.all_reduce(late, op=torch.distributed.ReduceOp.MAX)
    return bool(late.item())


def _same_on_every_rank(value: int, what: str) -> None:
    """``ValueError`` unless every rank read the same ``value`` (each rank decides from the files
    of ``--save`` / ``--load`` whether and where to resume: they must see the same files)."""
    bounds = torch.tensor([value, -value], dtype=torch.int64, device=device())
    torch.distributed.all_reduce(bounds, op=torch.distributed.ReduceOp.MAX)
    if bounds[0].item() != -bounds[1].item():
        raise ValueError(f"the ranks disagree on {what} (from {-bounds[1].item()} to {bounds[0].item()}): "
                         "--save and --load must be on a filesystem that every node sees")
