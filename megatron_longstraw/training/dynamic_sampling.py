"""Dynamic sampling (``--dynamic-sampling``, as in DAPO): prompt groups whose G rewards are all
equal are dropped and other prompts drawn in their place.

A group whose rewards are all equal has advantages of zero (``grpo/advantages.py``): its policy
gradient term is nothing, yet its replay costs as much as any other group's, and it counts in
the step's normalization, diluting the groups that do carry a signal. Once a policy solves (or
always fails) most prompts, most groups are such groups and learning stalls. Dynamic sampling
drops a group right after its rewards (its capture and rollouts are spent; its replay is not)
and draws the next prompt for the same slot of the step, up to ``--dynamic-sampling-max-draws``
draws per slot; the last draw is trained whatever its rewards, so every step trains
``--global-batch-size`` groups and the losses' normalizations stay what they are.

Every data-parallel rank draws the same number of prompts for each slot, so that the ranks keep
walking the dataset in step (``PromptSource``: rank ``r`` of ``d`` takes items ``r, r + d, ...``)
and a checkpoint's data position holds for all of them: a rank whose group for the slot is
already kept draws along and leaves its prompt unused until no rank needs another one (one
all-reduce of a flag per draw): such prompts are consumed unseen and counted nowhere (the
metrics count the groups a rank scored). Ranks that share a group (tensor, context and pipeline parallel
peers) drop it or keep it together (``agree_uniform``). Expert parallelism is refused with it
(``arguments.py``): its ranks' no-grad passes and replays would no longer come in the same counts.

Logged per step: ``dynamic_sampling/skipped_frac`` (dropped / scored groups over the
data-parallel ranks), ``dynamic_sampling/draws_per_group`` (scored groups per trained one) and ``reward/drawn_mean``, the mean reward over
every drawn group, dropped ones included (``reward/mean`` is over the trained groups, which
dynamic sampling biases towards the middle).
"""

from collections.abc import Callable
from typing import Optional

import torch
from megatron.core import parallel_state

from megatron_longstraw.distributed import device


def uniform_rewards(rewards_G: torch.Tensor) -> bool:
    """Whether the group's G rewards are all equal (its advantages are all zero)."""
    return bool((rewards_G == rewards_G[0]).all())


def agree_uniform(rewards_G: torch.Tensor) -> bool:
    """``uniform_rewards`` agreed by every rank that holds this group (tensor, context and pipeline
    parallel peers): uniform only where it is uniform on all of them, so a reward that is not
    deterministic cannot make the peers part ways."""
    flag = torch.tensor([float(uniform_rewards(rewards_G))], device=device())
    for group in (parallel_state.get_tensor_and_context_parallel_group(),
                  parallel_state.get_pipeline_model_parallel_group()):
        if torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (every rank gets the answer)."""
    if torch.distributed.get_world_size() == 1:
        return flag
    value = torch.tensor([float(flag)], device=device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def fill_groups(draw: Callable, train: Callable, slots: int,
                max_draws: Optional[int]) -> tuple[list[dict], dict, list[dict]]:
    """The step's trained groups' metrics, the dynamic-sampling metrics, and the work the dropped
    groups cost (``{"prompt/length", "tokens/response"}`` of what was captured and decoded for
    them, for the throughput metrics: the phases' times include it).

    ``draw()`` gives the next prompt group; ``train(group, drop_uniform)`` trains it and returns its
    metrics, or ``None`` when ``drop_uniform`` and its rewards are all equal (then the group's
    rewards are filled in). ``max_draws=None``: no dynamic sampling (one draw per slot, nothing
    dropped, no metrics added)."""
    if max_draws is None:
        return [train(draw(), False) for _ in range(slots)], {}, []
    assert max_draws >= 1, max_draws
    kept, rewards, spent = [], [], []
    drawn = dropped = 0
    for _ in range(slots):
        metrics = None
        for attempt in range(max_draws):
            group = draw()  # every rank draws: the ranks walk the data in step
            if metrics is None:
                scored, given = group.rewards_G is not None, bool(group.responses)
                metrics = train(group, attempt < max_draws - 1)
                drawn += 1
                dropped += metrics is None
                rewards.append(group.rewards_G.float().mean().item())
                if metrics is None and not scored:  # captured (and decoded, unless given) before dropped
                    spent.append({"prompt/length": float(group.prompt_ids_S.numel()),
                                  "tokens/response": 0.0 if given else float(sum(r.numel() for r in group.responses))})
            if not _any_rank(metrics is None):
                break
        assert metrics is not None  # the last draw is trained whatever its rewards
        kept.append(metrics)
    totals = torch.tensor([drawn, dropped, sum(rewards), slots], dtype=torch.float64, device=device())
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=False)
    if torch.distributed.get_world_size(dp_group) > 1:
        torch.distributed.all_reduce(totals, group=dp_group)
    drawn_all, dropped_all, reward_sum, slots_all = totals.tolist()
    return kept, {"dynamic_sampling/skipped_frac": dropped_all / drawn_all,
                  "dynamic_sampling/draws_per_group": drawn_all / slots_all,
                  "reward/drawn_mean": reward_sum / drawn_all}, spent
