"""The training loop of ``train_grpo.py``: ``--train-iters`` GRPO steps, each ``--global-batch-size``
prompt groups (``grpo_step.train_group``), the loss's end-of-step scale, Megatron's optimizer,
metrics and checkpoints. Imported after the command line is parsed (``train_grpo.main``)."""

import json
import time
from pathlib import Path

import torch
from megatron.core import parallel_state

from megatron_longstraw.checkpointing.model_checkpoint import resolve_checkpoint_dir
from megatron_longstraw.config import cli
from megatron_longstraw.config.trainer import TrainerConfig
from megatron_longstraw.distributed import device
from megatron_longstraw.grpo.loss_base import StepShape
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
from megatron_longstraw.training.startup import model_source, resume_path


def train(config: TrainerConfig):
    """Run ``--train-iters`` optimizer steps; returns the last step's metrics and the model
    (``{}, None`` when the checkpoint to resume is already at ``--train-iters``: nothing is touched)."""
    rank0 = torch.distributed.get_rank() == 0
    train_iters, ckpt = config.training.train_iters, config.checkpoint
    load = resume_path(config)
    done = checkpoint_iteration(load) if load else 0
    _same_on_every_rank(done, "the iteration to resume from")
    if load and not config.evaluation.skip_train:
        if done >= train_iters:
            if rank0:
                print(f"nothing to do: {resolve_checkpoint_dir(load)} is at iteration {done}, "
                      f"--train-iters is {train_iters}", flush=True)
            return {}, None
    check_plan(config, policy_hf_config(config), rank0)  # before any weight is allocated
    hf, model, reference, tokenizer = build_policy(config)
    ddp = wrap_ddp(model, config.parallel)
    optimizer = build_optimizer(ddp, config.optimizer, config.parallel, bf16=config.precision.bf16)
    scheduler = build_scheduler(optimizer, config.optimizer, train_iters)
    source = build_prompt_source(config, hf, tokenizer)
    reward_fn = build_reward_fn(config.reward, tokenizer, source)  # called once here: a broken reward fails now
    iteration, trainer_state = 0, {}
    assets = run_assets(config, load)  # what every save carries for export (tokenizer, generation config)
    if load:
        load_start = time.perf_counter()
        restored = load_checkpoint(load, model, optimizer, scheduler, reference)
        iteration, trainer_state = restored["iteration"], restored["trainer"]
        source.load_state_dict(trainer_state["data"])
        if rank0:
            auto = " (the latest in --save; --no-load starts fresh)" if ckpt.load is None else ""
            print(f"resuming from {resolve_checkpoint_dir(load)} at iteration {iteration}{auto}, loaded in "
                  f"{time.perf_counter() - load_start:.1f} s", flush=True)
    if config.evaluation.skip_train:
        return evaluate_checkpoint(model, source, config, reward_fn, tokenizer.eos_id, iteration, rank0), model
    policy_loss = get_policy_loss(config.loss.loss_type)
    # the flags as given, and what the run made of them
    resolved = dict(model_source=model_source(config), load=str(load) if load else None, train_iters=train_iters,
                    data_parallel_size=config.data_parallel_size, groups_per_rank=config.groups_per_rank,
                    loss_aggregation=policy_loss.aggregation_of(config.loss), lr_decay_iters=config.lr_decay_iters)
    logger = RunLogger(config.logging, train_iters, dict(cli.as_dict(config), resolved=resolved),
                       run_id=trainer_state.get("wandb_run_id"), resume_step=iteration)
    generator = torch.Generator(device=device())  # sampling; reseeded per step so resumes are exact
    dp_rank = parallel_state.get_data_parallel_rank()
    step_shape = StepShape(groups_per_rank=config.groups_per_rank, data_parallel_size=config.data_parallel_size,
                           max_response_length=config.rollout.max_response_length)
    curriculum = config.curriculum
    sampling = config.grpo
    metrics = {}
    began = time.monotonic()  # --exit-duration-in-mins counts from here
    try:
        while iteration < train_iters:
            start, clock = time.perf_counter(), PhaseClock()
            generator.manual_seed(hash((config.training.seed, iteration, dp_rank)) % 2 ** 63)  # same on TP ranks
            for chunk in ddp:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            if curriculum is not None:  # the curriculum: a function of the step alone
                source.set_prompt_length(curriculum.length_at(iteration))
            groups, sampling_metrics, dropped_work = fill_groups(
                source.next_group,
                lambda group, drop_uniform: train_group(
                    model, group, config, step_shape, reward_fn=reward_fn, eos_id=tokenizer.eos_id,
                    generator=generator, reference=reference, clock=clock, drop_uniform=drop_uniform),
                step_shape.groups_per_rank,
                sampling.dynamic_sampling_max_draws if sampling.dynamic_sampling else None)
            metrics = reduce_step_metrics(groups, policy_loss.summed_metrics)
            metrics.update(sampling_metrics)
            # the loss's end-of-step normalizer
            gradient_scale = policy_loss.finish_step(metrics, config.loss, step_shape)
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
            if iteration == 1 and ckpt.overwrite and not ckpt.no_save:  # a fresh run writes from now on
                set_aside_tracker(ckpt.save)
            if curriculum is not None:
                metrics["curriculum/prompt_length"] = float(source.dataset.task.prompt_length)
            eval_interval = config.evaluation.eval_interval
            if eval_interval and iteration % eval_interval == 0:
                with clock("eval"):
                    metrics.update(evaluate(model, source.dataset.task, config.eval_lengths, config, reward_fn,
                                            tokenizer.eos_id, iteration))
            metrics.update(clock.metrics)
            metrics.update(throughput_metrics(hf, model, groups, clock.metrics, config.logging.peak_tflops,
                                              dropped=dropped_work))
            metrics.update({"optim/grad_norm": grad_norm if grad_norm is not None else float("nan"),
                            "optim/lr": lr, "optim/update_ok": float(update_ok),
                            "time/step_s": time.perf_counter() - start})
            if torch.cuda.is_available():
                metrics["mem/peak_gib"] = max(v for k, v in clock.metrics.items() if k.startswith("mem/"))
            out_of_time = _out_of_time(began, ckpt.exit_duration_in_mins) and iteration < train_iters
            try:
                if not ckpt.no_save and (iteration == train_iters or out_of_time or
                                         (ckpt.save_interval and iteration % ckpt.save_interval == 0)):
                    save_start = time.perf_counter()
                    state = {"data": source.state_dict(), "wandb_run_id": logger.run_id}
                    save_checkpoint(ckpt.save, iteration, model, optimizer, scheduler, state, hf, reference, assets)
                    metrics["time/save_s"] = time.perf_counter() - save_start
            finally:  # the step's metrics, with its save's time; also when the save fails
                logger.log(iteration, metrics)
            if out_of_time:
                if rank0:
                    saved = ("no checkpoint (--no-save): nothing to resume" if ckpt.no_save
                             else f"saved iteration {iteration}, the same command resumes")
                    print(f"stopping at iteration {iteration} of {train_iters}: --exit-duration-in-mins "
                          f"{ckpt.exit_duration_in_mins:g} reached; {saved}", flush=True)
                break
    finally:
        logger.finish()
    return metrics, model


def evaluate_checkpoint(model, source, config: TrainerConfig, reward_fn, eos_id: int, iteration: int,
                        rank0: bool) -> dict:
    """``--skip-train``: the held-out eval figures of the loaded weights at ``--eval-prompt-lengths``,
    printed as one JSON line and written (rank 0, atomically) to
    ``<--wandb-save-dir>/eval_iter_<iteration>.json``."""
    metrics = evaluate(model, source.dataset.task, config.eval_lengths, config, reward_fn, eos_id, iteration)
    if rank0:
        record = {"iteration": iteration, "eval_prompts": config.evaluation.eval_prompts,
                  "lengths": config.eval_lengths, **metrics}
        path = Path(config.logging.wandb_save_dir) / f"eval_iter_{iteration:07d}.json"
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
