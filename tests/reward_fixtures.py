"""Reward functions for trainer tests, loaded with ``--reward-fn reward_fixtures:<name>``."""


def low_token_fraction(prompt_ids, response_ids, answer, metadata) -> float:
    """Dense, deterministic reward: the fraction of response tokens with an id below 128. A
    random policy gets varied rewards (non-zero advantages), so every step changes the weights."""
    return float((response_ids < 128).float().mean())


def raises(prompt_ids, response_ids, answer, metadata) -> float:
    raise RuntimeError("reward backend is down")


def nan(prompt_ids, response_ids, answer, metadata) -> float:
    return float("nan")


def uniform_on_odd_prompts(prompt_ids, response_ids, answer, metadata) -> float:
    """``low_token_fraction`` on the synthetic prompts of even index, 0.0 on the odd ones: every
    odd prompt's group has equal rewards (what dynamic sampling drops)."""
    if metadata["index"] % 2:
        return 0.0
    return low_token_fraction(prompt_ids, response_ids, answer, metadata)
