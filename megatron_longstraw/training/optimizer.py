"""Megatron's DDP wrapper, optimizer (distributed where asked) and learning-rate scheduler."""

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_longstraw.config.parallel import ParallelConfig
from megatron_longstraw.config.training import OptimizerConfig
from megatron_longstraw.models.pipeline_stage import model_chunks


def wrap_ddp(model, parallel: ParallelConfig) -> list[DistributedDataParallel]:
    """Megatron DDP over the data-parallel group, one per model chunk (one without virtual
    pipeline stages; later chunks without bucketing, as Megatron's training wraps them);
    gradients accumulate in fp32 buffers."""
    config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=parallel.use_distributed_optimizer)
    return [DistributedDataParallel(chunk.config, config, chunk, disable_bucketing=v > 0)
            for v, chunk in enumerate(model_chunks(model))]


def finish_gradients(ddp_chunks: list[DistributedDataParallel]) -> None:
    """Megatron's ``finalize_model_grads`` before the optimizer step: the DP x CP gradient
    reduction, and the TP sums of the gradients of replicated parameters that each TP rank
    computes only in part (q/k norms, Gated DeltaNet's output norm via ``patches``, norms under
    sequence parallelism), the MoE router's expert-bias update, and the embedding sums across
    pipeline stages. ``finish_grad_sync`` alone does only the first: TP ranks would drift apart."""
    finalize_model_grads(ddp_chunks)


def build_optimizer(ddp_chunks: list[DistributedDataParallel], adam: OptimizerConfig, parallel: ParallelConfig,
                    bf16: bool):
    """Megatron's Adam (AdamW-style decoupled weight decay) with gradient clipping; fp32 main
    weights when the model is bf16."""
    config = McoreOptimizerConfig(
        optimizer="adam", lr=adam.lr, min_lr=adam.min_lr, weight_decay=adam.weight_decay,
        adam_beta1=adam.adam_beta1, adam_beta2=adam.adam_beta2, adam_eps=adam.adam_eps,
        clip_grad=adam.clip_grad, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=parallel.use_distributed_optimizer)
    # gloo groups exist only in CPU runs (distributed.init_distributed creates them there)
    return get_megatron_optimizer(config, ddp_chunks,
                                  use_gloo_process_groups=torch.distributed.get_backend() == "gloo")


def build_scheduler(optimizer, adam: OptimizerConfig, train_iters: int) -> OptimizerParamScheduler:
    """Megatron's scheduler, stepped once per optimizer step (iterations, not samples). On resume
    the command line's schedule applies from the checkpoint's step on."""
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if adam.lr_warmup_iters else adam.lr, max_lr=adam.lr, min_lr=adam.min_lr,
        lr_warmup_steps=adam.lr_warmup_iters, lr_decay_steps=adam.decay_iters(train_iters),
        lr_decay_style=adam.lr_decay_style, start_wd=adam.weight_decay, end_wd=adam.weight_decay,
        wd_incr_steps=train_iters, wd_incr_style="constant",
        # on resume the flags (e.g. a longer --train-iters) win; the step count comes from the checkpoint
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
