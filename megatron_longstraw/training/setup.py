"""What ``train_grpo.py`` builds from its arguments: the policy (and frozen reference), the
tokenizer, the prompt source and the reward function."""

import itertools

import torch

from megatron_longstraw.checkpointing.model_checkpoint import load_model_checkpoint, resolve_model_config
from megatron_longstraw.distributed import device
from megatron_longstraw.data.external_rollouts import ExternalRolloutDataset
from megatron_longstraw.data.prompts import PromptDataset, resolve_max_prompt_length
from megatron_longstraw.data.synthetic import KeyValueRetrievalTask, SyntheticRetrievalDataset
from megatron_longstraw.data.tokenizer import build_tokenizer
from megatron_longstraw.longstraw.prompt_backward import check_prompt_gradient_support
from megatron_longstraw.models.builder import build_stage_model
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.registry import family_for, register_family
from megatron_longstraw.rewards.registry import build_reward
from megatron_longstraw.rewards.scoring import score_group
from megatron_longstraw.training.grpo_step import PromptGroup


def policy_hf_config(args) -> dict:
    """The policy's HF config (``args.model_source``'s, ``validate_args``), with
    ``--max-position-embeddings`` applied; ``--model-family`` registers an out-of-tree family first."""
    if args.model_family:
        register_family(args.model_family)
    from_checkpoint = args.model_source == args.pretrained_checkpoint
    hf = resolve_model_config(args.model_source, flag="--pretrained-checkpoint" if from_checkpoint else
                              "--hf-config" if args.hf_config else "--model")
    if args.max_position_embeddings:
        hf["max_position_embeddings"] = args.max_position_embeddings
    return hf


def build_policy(args):
    """``(hf_config, model, reference or None, tokenizer)``. ``--model-family`` registers an
    out-of-tree family first; the family refuses layouts it lacks. The model config is
    ``args.model_source``'s (``validate_args``): ``--pretrained-checkpoint`` (a converted Megatron
    checkpoint) gives the model and the initial weights; the reference is a frozen copy of them,
    kept only when ``--kl-coef`` > 0."""
    hf = policy_hf_config(args)
    family = family_for(hf["model_type"])
    family.check_layout(family.normalize_hf_config(hf), args.parallel, args.rollout_source)
    options = ModelOptions(
        transformer_impl=args.transformer_impl, params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        fp8_format=args.fp8_format, fp8_recipe=args.fp8_recipe, sequence_parallel=args.sequence_parallel,
        recompute_granularity=args.recompute_granularity, kernel_options=args.kernels)
    model = build_stage_model(hf, options)  # under virtual pipeline stages: a StageChunks
    if args.prompt_gradient == "exact" and args.replay_mode == "longstraw":
        check_prompt_gradient_support(model)
    if args.pretrained_checkpoint:
        load_model_checkpoint(model, args.pretrained_checkpoint, flag="--pretrained-checkpoint")
    reference = None
    if args.kl_coef > 0:
        reference = build_stage_model(hf, options)
        reference.load_state_dict(model.state_dict())
        reference.requires_grad_(False)
    tokenizer = build_tokenizer(dict(tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                                     vocab_size=hf["vocab_size"]))
    if tokenizer.vocab_size > hf["vocab_size"]:
        raise ValueError(f"--tokenizer-model: the tokenizer's {tokenizer.vocab_size} ids exceed the model's "
                         f"vocabulary of {hf['vocab_size']}")
    return hf, model, reference, tokenizer


class PromptSource:
    """Prompt groups for the trainer from one dataset, with its checkpointable position. Every
    data-parallel rank walks the same order; rank ``r`` of ``d`` takes items ``r, r + d, ...``."""

    def __init__(self, dataset):
        from megatron.core import parallel_state

        self.dataset = dataset
        self.dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=False)
        self.dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=False)

    def next_group(self) -> PromptGroup:
        """This rank's next prompt (with its responses and rewards for external rollouts)."""
        items = [next(self.dataset) for _ in range(self.dp_size)]
        item = items[self.dp_rank]
        group = PromptGroup(item.prompt_ids_P.to(device()), item.answer, item.metadata, source=item.source)
        if hasattr(item, "responses"):  # external rollouts
            group.responses = [r.to(device()) for r in item.responses]
            group.rewards_G = None if item.rewards_G is None else item.rewards_G.to(device())
            group.sampler_logprobs = (None if item.sampler_logprobs is None
                                      else [lp.to(device()) for lp in item.sampler_logprobs])
        return group

    def set_prompt_length(self, length: int) -> None:
        """The synthetic task's prompts from now on have ``length`` tokens (a curriculum stage)."""
        task = self.dataset.task
        if task.prompt_length != length:
            self.dataset.task = task.variant(prompt_length=length)

    def state_dict(self) -> dict:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state)


def build_prompt_source(args, hf: dict, tokenizer) -> PromptSource:
    """Synthetic retrieval task, JSONL prompts, or external rollouts (``--rollout-source jsonl``)."""
    max_prompt = resolve_max_prompt_length(args.max_prompt_length, hf["max_position_embeddings"],
                                           args.max_response_length)
    if args.rollout_source == "jsonl":
        return PromptSource(ExternalRolloutDataset(
            args.rollout_path, tokenizer, num_generations=args.num_generations, vocab_size=hf["vocab_size"],
            max_prompt_length=max_prompt, max_response_length=args.max_response_length, seed=args.seed,
            flag="--rollout-path", logprobs_for=None if args.rollout_correction == "none" else args.rollout_correction))
    if args.data_path == "synthetic":
        if args.synthetic_prompt_length > max_prompt:
            flag = "--prompt-length-schedule" if args.curriculum else "--synthetic-prompt-length"
            raise ValueError(f"{flag} {args.prompt_length_schedule or args.synthetic_prompt_length}: "
                             f"{args.synthetic_prompt_length} tokens exceed the longest prompt the model takes "
                             f"({max_prompt})")
        if (args.eval_interval or args.skip_train) and max(args.eval_lengths) > max_prompt:
            raise ValueError(f"--eval-prompt-lengths: {max(args.eval_lengths)} tokens exceed the longest prompt "
                             f"the model takes ({max_prompt})")
        task = KeyValueRetrievalTask(hf["vocab_size"], args.synthetic_prompt_length,
                                     num_records=args.synthetic_num_records,
                                     value_length=args.synthetic_value_length, key_length=1,
                                     vocab_hi=args.synthetic_vocab_size,
                                     eos_id=tokenizer.eos_id, seed=args.seed)
        stages = [n for n, _ in args.curriculum.stages] if args.curriculum else []
        for flag, lengths in (("--prompt-length-schedule", stages),
                              ("--eval-prompt-lengths", args.eval_lengths if args.eval_interval or args.skip_train
                               else [])):
            for length in lengths:  # every stage and eval length makes prompts, checked now
                try:
                    task.variant(prompt_length=length)
                except ValueError as err:
                    raise ValueError(f"{flag}: {err}") from None
        return PromptSource(SyntheticRetrievalDataset(task, seed=args.seed))
    return PromptSource(PromptDataset(args.data_path, tokenizer, vocab_size=hf["vocab_size"],
                                      max_prompt_length=max_prompt, seed=args.seed, flag="--data-path"))


def build_reward_fn(args, tokenizer, source: PromptSource | None = None):
    """The ``--reward-fn`` reward. Given the prompt ``source``, it is called once right away
    (``check_reward_fn``), so a reward that fails does so at start-up, not after the first
    group's capture and rollout."""
    reward = build_reward(args.reward_fn, eos_id=tokenizer.eos_id, tokenizer=tokenizer,
                          partial_credit=args.reward_partial_credit)
    if source is not None:
        check_reward_fn(reward, source.dataset, tokenizer.eos_id)
    return reward


def check_reward_fn(reward, dataset, eos_id: int | None) -> None:
    """Call ``reward`` on the dataset's first record that it would score (external rollouts skip
    groups whose file gives their rewards; none left: no call), with a one-token response (EOS)
    for sampled rollouts or the record's first response; what it raises or returns is checked
    as in training (``score_group``: a ``ValueError`` naming ``--reward-fn`` and the record)."""
    for i in itertools.count():
        try:
            item = dataset[i]
        except IndexError:
            return
        if getattr(item, "rewards_G", None) is None:
            break
    responses = getattr(item, "responses", None) or [torch.tensor([0 if eos_id is None else eos_id])]
    score_group(reward, item.prompt_ids_P.to(device()), [responses[0].to(device())], item.answer, item.metadata,
                source=f"{item.source} (start-up check)")
