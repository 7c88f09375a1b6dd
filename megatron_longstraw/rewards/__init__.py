"""Rewards for GRPO: built-ins by name, user functions by ``module:function``, group scoring.

Common per-sample signature: ``reward(prompt_ids, response_ids, answer, metadata) -> float``.
``build_reward(--reward-fn, ...)`` picks one; ``score_group(fn, ...)`` returns ``rewards_G``.
"""

from megatron_longstraw.rewards.builtin import BUILTIN_REWARDS, cut_at_eos
from megatron_longstraw.rewards.context import RewardContext
from megatron_longstraw.rewards.registry import (REWARDS, RewardFunction, build_reward,
                                                 load_user_reward, register_reward)
from megatron_longstraw.rewards.scoring import score_group

__all__ = ["BUILTIN_REWARDS", "REWARDS", "RewardContext", "RewardFunction", "build_reward",
           "cut_at_eos", "load_user_reward", "register_reward", "score_group"]
