"""What ``train_grpo.py`` builds from its configuration: the policy (and frozen reference), the
tokenizer, the prompt source and the reward function."""

import itertools

import torch

from megatron_longstraw.checkpointing.model_checkpoint import load_model_checkpoint, model_hf_config
from megatron_longstraw.config.grpo import RewardConfig
from megatron_longstraw.config.trainer import TrainerConfig
from megatron_longstraw.data.external_rollouts import ExternalRolloutDataset
from megatron_longstraw.data.prompts import PromptDataset, resolve_max_prompt_length
from megatron_longstraw.data.synthetic import KeyValueRetrievalTask, SyntheticRetrievalDataset
from megatron_longstraw.data.tokenizer import build_tokenizer
from megatron_longstraw.distributed import device
from megatron_longstraw.longstraw.prompt_backward import check_prompt_gradient_support
from megatron_longstraw.models.builder import build_stage_model
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.registry import family_for, use_family
from megatron_longstraw.rewards.registry import build_reward
from megatron_longstraw.rewards.scoring import score_group
from megatron_longstraw.training.grpo_step import PromptGroup
from megatron_longstraw.training.startup import model_source, model_source_flag


def policy_hf_config(config: TrainerConfig) -> dict:
    """The policy's HF config (``training/startup.py``'s ``model_source``), with ``--num-layers``
    and ``--max-position-embeddings`` applied; ``--model-family`` registers an out-of-tree family
    first."""
    if config.model.model_family:
        use_family(config.model.model_family)
    source = model_source(config)
    return model_hf_config(config.model, source, flag=model_source_flag(config, source))


def build_policy(config: TrainerConfig):
    """``(hf_config, model, reference or None, tokenizer)``. ``--model-family`` registers an
    out-of-tree family first; the family refuses layouts it lacks. The model config is
    ``model_source``'s: ``--pretrained-checkpoint`` (a converted Megatron checkpoint) gives the
    model and the initial weights; the reference is a frozen copy of them, kept only when
    ``--kl-coef`` > 0."""
    hf = policy_hf_config(config)
    family = family_for(hf["model_type"])
    family.check_layout(family.normalize_hf_config(hf), config.parallel.sizes, config.rollout.rollout_source)
    options = ModelOptions.of(config.model, config.precision, config.parallel, config.kernels)
    model = build_stage_model(hf, options)  # under virtual pipeline stages: a StageChunks
    if config.longstraw.exact_sweep:
        check_prompt_gradient_support(model)
    pretrained = config.checkpoint.pretrained_checkpoint
    if pretrained:
        load_model_checkpoint(model, pretrained, flag="--pretrained-checkpoint")
    reference = None
    if config.loss.kl_coef > 0:
        reference = build_stage_model(hf, options)
        reference.load_state_dict(model.state_dict())
        reference.requires_grad_(False)
    tokenizer = build_tokenizer(config.data.tokenizer_type, config.data.tokenizer_model, vocab_size=hf["vocab_size"])
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


def build_prompt_source(config: TrainerConfig, hf: dict, tokenizer) -> PromptSource:
    """Synthetic retrieval task, JSONL prompts, or external rollouts (``--rollout-source jsonl``)."""
    data, rollout, seed = config.data, config.rollout, config.training.seed
    max_prompt = resolve_max_prompt_length(data.max_prompt_length, hf["max_position_embeddings"],
                                           rollout.max_response_length)
    if rollout.rollout_source == "jsonl":
        correction = config.loss.rollout_correction
        return PromptSource(ExternalRolloutDataset(
            rollout.rollout_path, tokenizer, num_generations=config.grpo.num_generations, vocab_size=hf["vocab_size"],
            max_prompt_length=max_prompt, max_response_length=rollout.max_response_length, seed=seed,
            flag="--rollout-path", logprobs_for=None if correction == "none" else correction))
    if data.synthetic:
        longest = data.longest_synthetic_prompt
        if longest > max_prompt:
            given = data.prompt_length_schedule or data.synthetic_prompt_length
            raise ValueError(f"{data.synthetic_length_flag} {given}: {longest} tokens exceed the longest prompt the "
                             f"model takes ({max_prompt})")
        evaluated = config.eval_lengths if config.evaluation.enabled else []
        if evaluated and max(evaluated) > max_prompt:
            raise ValueError(f"--eval-prompt-lengths: {max(evaluated)} tokens exceed the longest prompt "
                             f"the model takes ({max_prompt})")
        task = KeyValueRetrievalTask(hf["vocab_size"], longest, num_records=data.synthetic_num_records,
                                     value_length=data.synthetic_value_length, key_length=1,
                                     vocab_hi=data.synthetic_vocab_size, eos_id=tokenizer.eos_id, seed=seed)
        stages = [n for n, _ in config.curriculum.stages] if config.curriculum else []
        for flag, lengths in (("--prompt-length-schedule", stages), ("--eval-prompt-lengths", evaluated)):
            for length in lengths:  # every stage and eval length makes prompts, checked now
                try:
                    task.variant(prompt_length=length)
                except ValueError as err:
                    raise ValueError(f"{flag}: {err}") from None
        return PromptSource(SyntheticRetrievalDataset(task, seed=seed))
    return PromptSource(PromptDataset(data.data_path, tokenizer, vocab_size=hf["vocab_size"],
                                      max_prompt_length=max_prompt, seed=seed, flag="--data-path"))


def build_reward_fn(config: RewardConfig, tokenizer, source: PromptSource | None = None):
    """The ``--reward-fn`` reward. Given the prompt ``source``, it is called once right away
    (``check_reward_fn``), so a reward that fails does so at start-up, not after the first
    group's capture and rollout."""
    reward = build_reward(config.reward_fn, eos_id=tokenizer.eos_id, tokenizer=tokenizer,
                          partial_credit=config.reward_partial_credit)
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
