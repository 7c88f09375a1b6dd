"""``train_grpo.py`` arguments: Megatron-style flags in argparse groups, one validation function.

Defaults are the embedded demo: the tiny hybrid model (``qwen3.5-debug``) on the built-in
synthetic retrieval task, a few steps on CPU (or GPU), wandb offline, a checkpoint under runs/.

The parser imports no torch, Megatron or transformers (``--help`` answers at once); what needs
them (the registered losses, the parallel layout, an out-of-tree model family) is checked after
parsing, in ``validate_args``.
"""

import argparse
import dataclasses
import math
import os
from pathlib import Path

from megatron_longstraw.attention.kernel_options import (
    ATTENTION_BACKENDS, DSA_TOPK_MODES, FP8_ATTENTION_MODES, KernelOptions)


DEFAULT_MODEL = "qwen3.5-debug"


def _model(p):
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="preset name, HF folder / config.json, or a checkpoint folder (tools/convert_checkpoint.py "
                        "output or a trainer save: its hf_config.json) (default: the --pretrained-checkpoint's "
                        f"model, else {DEFAULT_MODEL})")
    g.add_argument("--hf-config", default=None, help="HF config.json or folder (overrides --model; default: unset)")
    g.add_argument("--model-family", default=None, metavar="MODULE_OR_PATH",
                   help="an out-of-tree model family (dotted module path or .py file) serving its MODEL_TYPES; "
                        "registered before --model / --hf-config is resolved (default: the built-in families)")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="override the model's position budget (RoPE extrapolation; default: the model's)")
    g.add_argument("--transformer-impl", default="local", choices=["local", "transformer_engine"],
                   help="Megatron's layers: local (plain torch) or transformer_engine (needs Transformer "
                        "Engine; FP8)")
    g.add_argument("--recompute-granularity", default=None, choices=["full"],
                   help="full: recompute each layer's activations in backward instead of keeping them "
                        "(default: keep them)")


def _parallel(p):
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="TP: ranks that split each layer's weights and heads")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="CP: ranks that split each prompt's positions (pages stay, queries travel)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1, help="EP: ranks that split the MoE experts")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="PP: pipeline stages, each a run of consecutive layers")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=1,
                   help="model chunks per pipeline rank (Megatron's interleaved schedule)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with TP: split the activations outside attention and MLP over the sequence")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the optimizer state over the data-parallel ranks (Megatron's distributed optimizer)")


def _precision(p):
    g = p.add_argument_group("precision")
    g.add_argument("--bf16", action="store_true", help="bf16 parameters with fp32 main weights")
    g.add_argument("--fp8-format", default=None, choices=["hybrid", "e4m3"],
                   help="FP8 matmuls through Transformer Engine: hybrid (e4m3 forward, e5m2 gradients) or e4m3 "
                        "(default: no FP8)")
    g.add_argument("--fp8-recipe", default="delayed", choices=["delayed", "tensorwise", "blockwise", "mxfp8"],
                   help="FP8 scaling recipe (with --fp8-format)")


def _optimizer(p):
    g = p.add_argument_group("optimizer and learning-rate schedule")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (Adam)")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of the decay")
    g.add_argument("--lr-decay-style", default="constant", choices=["constant", "linear", "cosine", "inverse-square-root"],
                   help="learning-rate schedule after the warm-up")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="steps of linear warm-up from 0 to --lr")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="steps over which the learning rate decays to --min-lr (default: --train-iters)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="decoupled (AdamW-style) weight decay")
    g.add_argument("--clip-grad", type=float, default=1.0, help="clip the global gradient norm to this; 0: no clipping")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam's first-moment decay")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam's second-moment decay")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam's epsilon")


def _training(p):
    g = p.add_argument_group("training")
    g.add_argument("--train-iters", type=int, default=4, help="optimizer steps of the run (a resume counts the loaded ones)")
    g.add_argument("--global-batch-size", type=int, default=2, help="prompt groups per optimizer step")
    g.add_argument("--seed", type=int, default=1234, help="seed of the initialization, the data and the sampling")


def _checkpointing(p):
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default="runs/grpo-demo/checkpoints",
                   help="checkpoint folder: iter_XXXXXXX/ per save, and the latest's number")
    g.add_argument("--load", default=None,
                   help="resume from this save directory or checkpoint (default: --save when it holds a checkpoint)")
    g.add_argument("--no-load", action="store_true",
                   help="start fresh even when --save holds a checkpoint (refused there without --overwrite)")
    g.add_argument("--overwrite", action="store_true",
                   help="let a fresh run use a --save that holds checkpoints (each replaced only when this run "
                        "saves that iteration; the earlier tracker is set aside after the first step) and a "
                        "--wandb-save-dir with an earlier run's metrics.jsonl (kept as metrics.jsonl.N)")
    g.add_argument("--save-interval", type=int, default=None, help="save every N steps (default: only at the end)")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="stop after the first step that ends this many minutes after training began (start-up "
                        "not counted), saving a checkpoint there unless --no-save; the same command run again "
                        "resumes from it (default: unset, run to --train-iters)")
    g.add_argument("--no-save", action="store_true", help="write no checkpoint (nor resume from --save)")
    g.add_argument("--pretrained-checkpoint", default=None,
                   help="initial weights and the model: a Megatron checkpoint from tools/convert_checkpoint.py "
                        "or a run's save (e.g. a --loss-type sft warm start: its weights only, the run starts at "
                        "step 1), whose hf_config.json gives the model (a --model / --hf-config must describe the "
                        "same architecture) (default: random initialization)")


def _logging(p):
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=1,
                   help="a console line every N steps (metrics.jsonl and wandb get every step)")
    g.add_argument("--wandb-project", default=None,
                   help="wandb project, logged online when credentials exist (default: megatron-longstraw, offline)")
    g.add_argument("--wandb-exp-name", default="grpo-demo", help="wandb run name")
    g.add_argument("--wandb-save-dir", default="runs/grpo-demo", help="folder of metrics.jsonl and the wandb files")
    g.add_argument("--wandb-mode", default=None, choices=["online", "offline", "disabled"],
                   help="default: online with --wandb-project and credentials, else offline")
    g.add_argument("--progress", action="store_true",
                   help="progress bars for capture and decoding also without a terminal")
    g.add_argument("--peak-tflops", type=float, default=785.0,
                   help="per-GPU peak for MFU (785: measured bf16 matmul peak of an H200)")


def _grpo(p):
    g = p.add_argument_group("GRPO")
    g.add_argument("--num-generations", type=int, default=4, help="G: responses per prompt")
    g.add_argument("--loss-type", default="grpo", metavar="NAME",
                   help="policy loss registered in grpo/registry.py: grpo (clipped surrogate), dr_grpo (Dr. GRPO: token sum "
                        "over max-response-length x responses, no std normalization), gspo (sequence-level "
                        "ratio and clip), cispo (REINFORCE with a clipped stop-gradient IS weight), sft (negative "
                        "log-likelihood of the records' given answers or responses: a warm start)")
    g.add_argument("--clip-eps-low", type=float, default=0.2,
                   help="ratio floor 1 - eps, shared by every loss (gspo clips sequence ratios: ~3e-4)")
    g.add_argument("--clip-eps-high", type=float, default=0.28,
                   help="ratio ceiling 1 + eps, shared by every loss (gspo clips sequence ratios: ~4e-4)")
    g.add_argument("--kl-coef", type=float, default=0.0,
                   help="coefficient of the KL penalty to a frozen reference model (kept only when > 0)")
    g.add_argument("--loss-aggregation", default=None, choices=["token", "sequence"],
                   help="default: the loss's own, token (gspo: sequence, the only one it takes; dr_grpo and "
                        "cispo take only token)")
    g.add_argument("--advantage-normalization", default=None, choices=["group-std", "none"],
                   help="default: the loss's own, group-std (dr_grpo: none, the only one it takes)")
    g.add_argument("--entropy-coef", type=float, default=0.0, help="coefficient of the entropy bonus")
    g.add_argument("--dynamic-sampling", action="store_true",
                   help="DAPO's dynamic sampling: a prompt group whose G rewards are all equal (zero advantages) is "
                        "dropped once scored and the next prompt drawn in its place (logged: "
                        "dynamic_sampling/skipped_frac)")
    g.add_argument("--dynamic-sampling-max-draws", type=int, default=4,
                   help="with --dynamic-sampling: prompts drawn at most per group of the step; the last draw "
                        "is trained whatever its rewards")


def _rollout(p):
    g = p.add_argument_group("rollout")
    g.add_argument("--max-response-length", type=int, default=8, help="most tokens of a sampled response")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; 0: greedy")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: the smallest set of tokens of this much probability")
    g.add_argument("--decode-cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="replay each decode step of internal rollouts and evaluation from a CUDA graph where "
                        "the model and layout allow it (a GPU; no tensor/context/pipeline/expert parallelism, MoE "
                        "layers, FP8 or learned position embedding; every stateful layer taking fixed shapes: "
                        "Qwen3.5's do, GLM-5's do not; rollouts of at least 4 steps); elsewhere decoding runs "
                        "eagerly; --no-decode-cuda-graphs: always eagerly")
    g.add_argument("--rollout-source", default="internal", choices=["internal", "jsonl"],
                   help="internal: sample G responses from the policy; jsonl: prompts and responses from "
                        "--rollout-path")
    g.add_argument("--rollout-path", default=None,
                   help="JSONL of prompts with G responses (--rollout-source jsonl; default: unset)")
    g.add_argument("--rollout-correction", default="none", choices=["none", "tis", "mis"],
                   help="importance correction between the sampler's log-probs and the trainer's: tis weighs "
                        "each token's policy term by min(pi_old / pi_sampler, cap), mis leaves out tokens whose "
                        "ratio is outside [1/cap, cap] and weighs the others by it; needs 'logprobs' in every --rollout-path record "
                        "(internal rollouts record their own)")
    g.add_argument("--rollout-correction-cap", type=float, default=2.0,
                   help="the cap C of --rollout-correction (a number >= 1)")


def _reward(p):
    g = p.add_argument_group("reward")
    g.add_argument("--reward-fn", default="synthetic_retrieval",
                   help="builtin name, or module:function (imported from sys.path or the working directory); "
                        "called once at start-up on the first record, so a broken one fails before training")
    g.add_argument("--reward-partial-credit", type=float, default=0.0,
                   help="synthetic_retrieval: credit c in [0, 1) times the correct fraction of a wrong value")


def _data(p):
    g = p.add_argument_group("data")
    g.add_argument("--data-path", default="synthetic", help="JSONL prompts, or 'synthetic'")
    g.add_argument("--max-prompt-length", type=int, default=None,
                   help="default: the model's positions minus --max-response-length")
    g.add_argument("--synthetic-prompt-length", type=int, default=256, help="tokens of a synthetic retrieval prompt")
    g.add_argument("--synthetic-num-records", type=int, default=4, help="key-value records hidden in a synthetic prompt")
    g.add_argument("--synthetic-value-length", type=int, default=1, help="tokens of a synthetic record's value")
    g.add_argument("--synthetic-vocab-size", type=int, default=None,
                   help="the task uses ids [0, N) only (markers, keys, values, filler); default: the model's")
    g.add_argument("--prompt-length-schedule", default=None, metavar="LENGTH:STEPS,...,LENGTH",
                   help="synthetic task curriculum, e.g. 512:200,4096:200,32768: each stage's prompt length for "
                        "its steps, the last to the end (replaces --synthetic-prompt-length, which becomes its "
                        "longest for the plan check; logged as curriculum/prompt_length; default: unset)")


def _evaluation(p):
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-interval", type=int, default=0,
                   help="every N steps, greedy and sampled reward on held-out synthetic prompts (eval/*); 0: never")
    g.add_argument("--skip-train", action="store_true",
                   help="no training: evaluate the checkpoint (--load, or the newest in --save) on held-out "
                        "synthetic prompts at --eval-prompt-lengths, print the eval/* figures and write them to "
                        "<--wandb-save-dir>/eval_iter_<N>.json")
    g.add_argument("--eval-prompts", type=int, default=16,
                   help="held-out prompts per length (a multiple of the data-parallel size)")
    g.add_argument("--eval-prompt-lengths", default=None,
                   help="comma-separated prompt lengths to evaluate at (default: the training length, the "
                        "schedule's last)")
    g.add_argument("--tokenizer-type", default="NullTokenizer",
                   choices=["NullTokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer"],
                   help="Megatron tokenizer (NullTokenizer: the data are token ids)")
    g.add_argument("--tokenizer-model", default=None,
                   help="tokenizer folder or file (every --tokenizer-type but NullTokenizer; default: unset)")


def _longstraw(p):
    g = p.add_argument_group("LongStraw")
    g.add_argument("--prompt-chunk-size", type=int, default=32768,
                   help="prompt tokens per no-grad capture chunk (memory: the state plus one chunk)")
    g.add_argument("--replay-micro-batch-size", type=int, default=1,
                   help="responses replayed (forward + backward) at a time against the prompt state")
    g.add_argument("--replay-mode", default="longstraw", choices=["longstraw", "full"],
                   help="longstraw: replay against the captured state; full: the full-graph baseline "
                        "(prompt + response per micro-batch, for comparison)")
    g.add_argument("--no-plan-check", action="store_true",
                   help="start even when the budget planner predicts a per-GPU peak over the GPU's memory "
                        "(tools/plan_budget.py; the plan's line is printed either way)")
    g.add_argument("--prompt-gradient", default="detached", choices=["detached", "exact"],
                   help="detached: the prompt state is a constant (LongStraw); exact: replay accumulates "
                        "the state's gradients over the group, then one chunked backward through the "
                        "prompt gives the full graph's gradient (with --replay-mode full: plain backprop "
                        "through prompt + response with nothing detached)")


def add_kernel_flags(g) -> None:
    """The attention kernels' flags (``KernelOptions``, whose defaults they take) on the argparse
    group ``g``: the trainer's ``kernels`` group and the benchmark's."""
    d = KernelOptions()
    g.add_argument("--attention-backend", default=d.attention_backend, choices=ATTENTION_BACKENDS,
                   help="fused kernels of full attention over the prompt state on a GPU; emulated: their "
                        "interface in plain torch (also on a CPU, for tests)")
    g.add_argument("--prefix-block", type=int, default=d.prefix_block,
                   help="prompt keys per fused full-attention call in capture and replay (bounds one call's transients)")
    g.add_argument("--decode-split-keys", type=int, default=d.decode_split_keys,
                   help="fewest prompt keys per split of a decode step's attention over the pages (the whole splits "
                        "run as one batched call, a shorter rest as a second; merged by log-sum-exp)")
    g.add_argument("--dsa-key-block", type=int, default=d.dsa_key_block,
                   help="DSA indexer keys scored at a time by the blockwise top-k")
    g.add_argument("--dsa-score-elements", type=int, default=d.dsa_score_elements,
                   help="fp32 elements of one block of DSA index scores (sets the indexer's query block)")
    g.add_argument("--dsa-gather-elements", type=int, default=d.dsa_gather_elements,
                   help="elements of one query block's gathered latents and scores in DSA sparse attention "
                        "(sets its query block)")
    g.add_argument("--fp8-attention", default=d.fp8_attention, choices=FP8_ATTENTION_MODES,
                   help="capture: the prompt capture's full attention in FP8 on Hopper (cuDNN's sdpa_fp8; needs "
                        "nvidia-cudnn-frontend; replay, decoding and the prompt backward stay in the model's dtype); "
                        "experimental: measured far from exact attention over a million keys "
                        "(docs/transformer_engine.md)")
    g.add_argument("--dsa-topk", default=d.dsa_topk, choices=DSA_TOPK_MODES,
                   help="how the DSA running top-k ranks a key block's fp32 scores: packed (every score in an "
                        "int64 with its position) or float (the block's fp32 top-k first); same selection")


def kernel_options_from_args(args) -> KernelOptions:
    """The validated ``KernelOptions`` of the parsed ``add_kernel_flags`` flags."""
    options = KernelOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(KernelOptions)})
    options.validate()
    return options


def _kernels(p):
    add_kernel_flags(p.add_argument_group("kernels"))


GROUPS = (_model, _parallel, _precision, _optimizer, _training, _checkpointing, _logging, _grpo,
          _rollout, _reward, _data, _evaluation, _longstraw, _kernels)


class HelpFormatter(argparse.HelpFormatter):
    """Ends each flag's help with its default, ``(default: X)``, unless the help states it itself
    (as every flag whose default is None does) or the flag is a switch (off unless given)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or "default" in text or any(
                action.default is unset for unset in (None, False, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"

    def _get_default_metavar_for_optional(self, action):
        return {int: "N", float: "X"}.get(action.type, action.dest.upper())


def build_parser() -> argparse.ArgumentParser:
    """The parser with every group."""
    parser = argparse.ArgumentParser(description="GRPO on LongStraw (capture once, replay each response)",
                                     usage="%(prog)s [options]", formatter_class=HelpFormatter)
    for group in GROUPS:
        group(parser)
    return parser


def _positive(args, *names):
    for name in names:
        value = getattr(args, name)
        if value is None or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def validate_args(args, world_size: int = 1) -> argparse.Namespace:
    """Check every flag and fill derived values; raises ``ValueError`` naming the flag."""
    from megatron_longstraw.distributed import ParallelSizes  # these import torch: after parsing
    from megatron_longstraw.grpo.registry import get_policy_loss
    from megatron_longstraw.models.registry import load_family

    _positive(args, "train_iters", "global_batch_size", "num_generations", "max_response_length",
              "prompt_chunk_size", "replay_micro_batch_size", "log_interval")
    if args.num_generations < 2:  # every loss trains on grpo/advantages.py's group_advantages
        raise ValueError(f"--num-generations must be >= 2, got {args.num_generations}: advantages are "
                         "group-relative (each reward minus its group's mean), so a group of one sample has "
                         "advantage 0 and nothing trains")
    if args.save_interval is not None and args.save_interval < 1:
        raise ValueError(f"--save-interval must be >= 1, got {args.save_interval}")
    if args.exit_duration_in_mins is not None and not args.exit_duration_in_mins > 0:
        raise ValueError(f"--exit-duration-in-mins must be > 0, got {args.exit_duration_in_mins}")
    args.parallel = ParallelSizes(args.tensor_model_parallel_size, args.context_parallel_size,
                                  args.expert_model_parallel_size, args.pipeline_model_parallel_size,
                                  args.num_virtual_stages_per_pipeline_rank)
    args.data_parallel_size = args.parallel.validate(world_size)
    args.kernels = kernel_options_from_args(args)
    if args.global_batch_size % args.data_parallel_size:
        raise ValueError(f"--global-batch-size {args.global_batch_size} must be divisible by the "
                         f"data-parallel size {args.data_parallel_size}")
    for flag in ("lr", "min_lr", "weight_decay", "clip_grad", "adam_eps"):
        value = getattr(args, flag)
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"--{flag.replace('_', '-')} must be a finite number >= 0, got {value}")
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr {args.min_lr} exceeds --lr {args.lr}")
    for flag in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be in [0, 1), got {getattr(args, flag)}")
    if args.lr_warmup_iters < 0:
        raise ValueError(f"--lr-warmup-iters must be >= 0, got {args.lr_warmup_iters}")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_decay_iters < 1:
        raise ValueError(f"--lr-decay-iters must be >= 1, got {args.lr_decay_iters}")
    if args.lr_warmup_iters >= args.lr_decay_iters:
        raise ValueError(f"--lr-warmup-iters {args.lr_warmup_iters} must be below --lr-decay-iters "
                         f"{args.lr_decay_iters} (default: --train-iters)")
    get_policy_loss(args.loss_type).validate_args(args)  # every loss flag, and the loss's defaults
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.rollout_source == "jsonl" and not args.rollout_path:
        raise ValueError("--rollout-source jsonl needs --rollout-path")
    if args.rollout_path and not os.path.isfile(args.rollout_path):
        raise ValueError(f"--rollout-path {args.rollout_path}: no such file")
    if args.data_path != "synthetic" and args.rollout_source == "internal" and not os.path.isfile(args.data_path):
        raise ValueError(f"--data-path {args.data_path}: no such file")
    _curriculum_and_evaluation(args)
    _dynamic_sampling(args)
    if args.tokenizer_type != "NullTokenizer" and not args.tokenizer_model:
        raise ValueError(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model")
    extra_family = None
    if args.model_family:
        try:
            extra_family = load_family(args.model_family)
        except ValueError as err:
            raise ValueError(f"--model-family: {err}") from None
    if ":" in args.reward_fn:  # imported now: a missing module or function fails before the model is built
        from megatron_longstraw.rewards.registry import load_user_reward

        load_user_reward(args.reward_fn)
    if args.fp8_format and args.transformer_impl != "transformer_engine":
        raise ValueError("--fp8-format needs --transformer-impl transformer_engine")
    for flag in ("load", "pretrained_checkpoint"):
        path = getattr(args, flag)
        if path is not None and not os.path.exists(path):
            raise ValueError(f"--{flag.replace('_', '-')} {path}: no such checkpoint")
    _resume_or_start_fresh(args)
    args.model_source = _model_source(args, extra_family)
    if args.parallel.pipeline > 1 and args.replay_mode != "longstraw":
        raise ValueError(f"--pipeline-model-parallel-size {args.parallel.pipeline} needs --replay-mode longstraw "
                         "(the full-graph baseline has no pipeline path)")
    if args.parallel.context > 1 and args.replay_mode != "longstraw":
        raise ValueError("--context-parallel-size > 1 needs --replay-mode longstraw (the full-graph "
                         "baseline has no CP path)")
    return args


def _dynamic_sampling(args) -> None:
    """``--dynamic-sampling``: its draw limit, and no expert parallelism (whose ranks exchange tokens
    in every MoE pass: a rank capturing a redrawn prompt while another replays would not pair up)."""
    if args.dynamic_sampling_max_draws < 1:
        raise ValueError(f"--dynamic-sampling-max-draws must be >= 1, got {args.dynamic_sampling_max_draws}")
    if args.dynamic_sampling and args.expert_model_parallel_size > 1:
        raise ValueError(f"--dynamic-sampling does not run with --expert-model-parallel-size "
                         f"{args.expert_model_parallel_size}: a rank that redraws captures while the others replay, and "
                         "expert-parallel ranks must run their MoE passes in step")


def _curriculum_and_evaluation(args) -> None:
    """``--prompt-length-schedule`` and ``--eval-*``: the synthetic task's (internal rollouts)."""
    from megatron_longstraw.training.curriculum import PromptLengthSchedule

    synthetic = args.data_path == "synthetic" and args.rollout_source == "internal"
    args.curriculum = None
    if args.prompt_length_schedule is not None:
        if not synthetic:
            raise ValueError("--prompt-length-schedule is for the synthetic task (--data-path synthetic, "
                             "internal rollouts)")
        args.curriculum = PromptLengthSchedule.parse(args.prompt_length_schedule)
        args.synthetic_prompt_length = args.curriculum.longest  # the plan check's and the positions'
    if args.eval_interval < 0:
        raise ValueError(f"--eval-interval must be >= 0, got {args.eval_interval}")
    if args.eval_interval or args.skip_train:
        flag = "--eval-interval" if args.eval_interval else "--skip-train"
        if not synthetic:
            raise ValueError(f"{flag} evaluates on held-out prompts of the synthetic task (--data-path "
                             "synthetic, internal rollouts)")
        if args.eval_prompts < 1 or args.eval_prompts % args.data_parallel_size:
            raise ValueError(f"--eval-prompts {args.eval_prompts} must be a positive multiple of the data-parallel "
                             f"size {args.data_parallel_size}")
    if args.eval_prompt_lengths is not None:
        try:
            lengths = [int(x) for x in args.eval_prompt_lengths.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--eval-prompt-lengths {args.eval_prompt_lengths!r}: comma-separated integers") from None
        if not lengths or min(lengths) < 1:
            raise ValueError(f"--eval-prompt-lengths {args.eval_prompt_lengths!r}: lengths >= 1 needed")
        args.eval_lengths = lengths
    else:
        args.eval_lengths = [args.curriculum.stages[-1][0] if args.curriculum
                             else args.synthetic_prompt_length]


def _resume_or_start_fresh(args) -> None:
    """``--load`` defaults to ``--save`` when it holds a checkpoint (``--no-load``, ``--no-save``:
    not). A fresh run never silently replaces an earlier one: without ``--overwrite`` it is
    refused where ``--save`` holds checkpoints or ``--wandb-save-dir`` holds metrics rows."""
    import re

    from megatron_longstraw.checkpointing.model_checkpoint import TRACKER_NAME
    from megatron_longstraw.training.run_logger import METRICS_NAME, has_rows

    if args.no_load and args.load is not None:
        raise ValueError(f"--no-load contradicts --load {args.load}")
    if args.skip_train:
        if args.load is None and (args.no_load or args.no_save or not (Path(args.save) / TRACKER_NAME).is_file()):
            raise ValueError(f"--skip-train: no checkpoint to evaluate (give --load, or a --save that holds one; "
                             f"--save is {args.save})")
        args.load = args.save if args.load is None else args.load
        return
    save = Path(args.save)
    tracker = save / TRACKER_NAME
    if args.load is None and not args.no_load and not args.no_save and tracker.is_file():
        args.load = args.save
        return
    if args.load is not None or args.overwrite:
        return
    saved = sorted(p.name for p in save.glob("iter_*") if re.fullmatch(r"iter_\d{7}", p.name) and p.is_dir())
    if not args.no_save and tracker.is_file():
        raise ValueError(f"--save {save} already holds a checkpoint (iteration {tracker.read_text().strip()}) and "
                         "--no-load starts fresh: add --overwrite to start anyway (a checkpoint is replaced only "
                         "when this run saves its iteration), or drop --no-load to resume from it")
    if not args.no_save and saved:
        raise ValueError(f"--save {save} holds checkpoints (the newest: {saved[-1]}) but no {TRACKER_NAME}, so a "
                         f"fresh run would replace them: resume one with --load {save / saved[-1]}, or start "
                         "fresh with --no-load --overwrite")
    metrics = Path(args.wandb_save_dir) / METRICS_NAME
    if has_rows(metrics) and not args.skip_train:  # --skip-train writes no metrics row
        why = ("--no-load" if args.no_load else "--no-save: nothing is resumed" if args.no_save
               else f"no checkpoint in --save {save}")
        raise ValueError(f"{metrics} holds an earlier run's metrics and this run starts fresh ({why}): add "
                         f"--overwrite to start anyway (that file is then kept as {METRICS_NAME}.N), or resume "
                         "that run with --load")


def _model_source(args, extra_family) -> str:
    """What the model config is read from: the ``--pretrained-checkpoint`` when it stores one
    (``--model`` / ``--hf-config``, when given, must describe the same architecture), else
    ``--hf-config``, ``--model`` or the default preset."""
    from megatron_longstraw.checkpointing.model_checkpoint import (has_hf_config, read_hf_config,
                                                                   resolve_checkpoint_dir, resolve_model_config)
    from megatron_longstraw.models.hf_config import architecture_differences
    from megatron_longstraw.models.registry import family_for

    flag, given = ("--hf-config", args.hf_config) if args.hf_config else ("--model", args.model)
    if args.pretrained_checkpoint is None:
        return given or DEFAULT_MODEL
    folder = resolve_checkpoint_dir(args.pretrained_checkpoint, flag="--pretrained-checkpoint")
    if not has_hf_config(folder):
        if given is None:
            raise ValueError(f"--pretrained-checkpoint {folder}: the checkpoint does not store its model "
                             "(no hf_config.json); pass --model")
        return given
    stored = read_hf_config(folder, flag="--pretrained-checkpoint")
    if given is None:
        return args.pretrained_checkpoint

    def normalized(hf):
        model_type = hf.get("model_type")
        family = extra_family if extra_family and model_type in extra_family.MODEL_TYPES else None
        try:
            family = family or family_for(model_type)
        except ValueError as err:  # an unknown model_type: name the file
            raise ValueError(f"{hf.get('_source', 'config')}: {err}") from None
        return family.normalize_hf_config(hf)

    differences = architecture_differences(normalized(resolve_model_config(given, flag=flag)), normalized(stored))
    if differences:
        shown = ", ".join(f"{field} {_short(mine)} vs {_short(theirs)}" for field, mine, theirs in differences)
        raise ValueError(f"{flag} {given} is another model than --pretrained-checkpoint {folder} ({shown}); "
                         f"leave out {flag} to train the checkpoint's model")
    return args.pretrained_checkpoint


def _short(value, limit: int = 60) -> str:
    """A config value on at most ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def parse_args(argv=None, world_size: int = 1) -> argparse.Namespace:
    """Parse and validate."""
    return validate_args(build_parser().parse_args(argv), world_size)
