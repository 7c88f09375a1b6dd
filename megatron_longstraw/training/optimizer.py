"""Megatron's DDP wrapper, optimizer (distributed where asked) and learning-rate scheduler."""

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_longstraw.models.pipeline_stage import model_chunks


def wrap_ddp(model, args) -> list[DistributedDataParallel]:
    """Megatron DDP over the data-parallel group, one per model chunk (one without virtual
    pipeline stages; later chunks without bucketing, as Megatron's training wraps them);
    gradients accumulate in fp32 buffers."""
    config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=args.use_distributed_optimizer)
    return [DistributedDataParallel(chunk.config, config, chunk, disable_bucketing=v > 0)
            for v, chunk in enumerate(model_chunks(model))]


def finish_gradients(ddp_chunks: list[DistributedDataParallel]) -> None:
    """Megatron's ``finalize_model_grads`` before the optimizer step: the DP x CP gradient
    reduction, and the TP sums of the gradients of replicated parameters that each TP rank
    computes only in part (q/k norms, Gated DeltaNet's output norm via ``patches``, norms under
    sequence parallelism), the MoE router's expert-bias update, and the embedding sums across
    pipeline stages. ``finish_grad_sync`` alone does only the first: TP ranks would drift apart."""
    finalize_model_grads(ddp_chunks)


def build_optimizer(ddp_chunks: list[DistributedDataParallel], args):
    """Megatron's Adam (AdamW-style decoupled weight decay) with gradient clipping; fp32 main
    weights when the model is bf16."""
    config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_distributed_optimizer=args.use_distributed_optimizer)
    # gloo groups exist only in CPU runs (distributed.init_distributed creates them there)
    return get_megatron_optimizer(config, ddp_chunks,
                                  use_gloo_process_groups=torch.distributed.get_backend() == "gloo")


def build_scheduler(optimizer, args) -> OptimizerParamScheduler:
    """Megatron's scheduler, stepped once per optimizer step (iterations, not samples). On resume
    the command line's schedule applies from the checkpoint's step on."""
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters, wd_incr_style="constant",
        # on resume the flags (e.g. a longer --train-iters) win; the step count comes from the checkpoint
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
