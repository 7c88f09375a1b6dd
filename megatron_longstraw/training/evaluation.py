"""Held-out evaluation (``--eval-interval``): prompts of the synthetic task drawn apart from the
training prompts, greedy and sampled, per prompt length.

The held-out prompts come from the same task with another seed (``EVAL_SEED_OFFSET``): other
records, keys, values and filler, so a training prompt reappears only by chance (likely only
with tiny vocabularies and prompts). Each prompt is captured once; one greedy response and
``--num-generations`` responses at ``--temperature`` are decoded from that state and scored by
the run's reward. The prompts are spread over the data-parallel ranks and the sums reduced, so
every rank logs the same figures: ``eval/greedy_reward`` and ``eval/sampled_reward`` (means
over the prompts), per length as ``eval/len<L>/greedy_reward`` and ``eval/len<L>/sampled_reward``.
"""

import torch
from megatron.core import parallel_state

from megatron_longstraw.config.trainer import TrainerConfig
from megatron_longstraw.data.synthetic import KeyValueRetrievalTask
from megatron_longstraw.distributed import device
from megatron_longstraw.longstraw.capture import capture_prompt
from megatron_longstraw.rewards.scoring import score_group
from megatron_longstraw.rollout.generate import generate_from_state

EVAL_SEED_OFFSET = 1_000_003
"""Added to ``--seed`` for the held-out task (a different seed: different prompts)."""


def held_out_task(task: KeyValueRetrievalTask, prompt_length: int, seed: int) -> KeyValueRetrievalTask:
    """``task`` at ``prompt_length`` with the held-out seed."""
    return task.variant(prompt_length=prompt_length, seed=seed + EVAL_SEED_OFFSET)


@torch.no_grad()
def evaluate(model, task: KeyValueRetrievalTask, lengths: list[int], config: TrainerConfig, reward_fn, eos_id: int,
             iteration: int) -> dict:
    """The eval metrics of the policy ``model`` on ``--eval-prompts`` held-out prompts per length."""
    dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=False)
    dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=False)
    generator = torch.Generator(device=device())
    seed, prompts, rollout = config.training.seed, config.evaluation.eval_prompts, config.rollout
    out = {}
    for length in lengths:
        held_out = held_out_task(task, length, seed)
        sums = torch.zeros(2, dtype=torch.float64, device=device())  # greedy, sampled
        for index in range(dp_rank, prompts, dp_size):
            prompt_ids_P, answer_A, metadata = held_out.generate(index)
            prompt_ids_1P = prompt_ids_P.to(device())[None]
            generator.manual_seed(hash((seed, iteration, index)) % 2 ** 63)  # same on every model-parallel rank
            state = capture_prompt(model, prompt_ids_1P, config.longstraw.prompt_chunk_size)
            try:
                greedy = generate_from_state(model, state, 1, rollout.max_response_length, temperature=0.0,
                                             eos_id=eos_id, generator=generator, cuda_graphs=rollout.decode_cuda_graphs)
                sampled = generate_from_state(model, state, config.grpo.num_generations, rollout.max_response_length,
                                              temperature=rollout.temperature, top_p=rollout.top_p, eos_id=eos_id,
                                              generator=generator, cuda_graphs=rollout.decode_cuda_graphs)
            finally:
                state.free()
            source = f"eval:{length}:{index}"
            answer = answer_A.tolist()
            sums[0] += score_group(reward_fn, prompt_ids_P, greedy.responses, answer, metadata, source=source).float().mean()
            sums[1] += score_group(reward_fn, prompt_ids_P, sampled.responses, answer, metadata, source=source).float().mean()
        if dp_size > 1:
            torch.distributed.all_reduce(sums, group=parallel_state.get_data_parallel_group(with_context_parallel=False))
        greedy_mean, sampled_mean = (sums / prompts).tolist()
        out[f"eval/len{length}/greedy_reward"] = greedy_mean
        out[f"eval/len{length}/sampled_reward"] = sampled_mean
    out["eval/greedy_reward"] = sum(out[f"eval/len{n}/greedy_reward"] for n in lengths) / len(lengths)
    out["eval/sampled_reward"] = sum(out[f"eval/len{n}/sampled_reward"] for n in lengths) / len(lengths)
    return out
