"""Rewards: built-ins by name, user functions by module:function, group scoring and its errors."""

import math
import sys

import numpy as np
import pytest
import torch

from megatron_longstraw.data.synthetic import KeyValueRetrievalTask
from megatron_longstraw.rewards import REWARDS, build_reward, register_reward, score_group

EOS = 9
PROMPT = torch.tensor([1, 2, 3])


def _score(reward, responses, answer, **kwargs):
    return score_group(reward, PROMPT, responses, answer, None, **kwargs).tolist()


def test_exact_match_on_ids():
    reward = build_reward("exact_match", eos_id=EOS)
    assert reward.name == "exact_match"
    responses = [[4, 5, EOS], [4, 5, EOS, 7, 7], [4, 5], [4, 6, EOS], [4, 5, 6, EOS], [EOS]]
    assert _score(reward, responses, [4, 5, EOS]) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert _score(reward, [torch.tensor([4, 5, EOS])], torch.tensor([4, 5])) == [1.0]


def test_exact_match_on_text_uses_the_tokenizer():
    from megatron_longstraw.data.tokenizer import build_tokenizer

    null = build_tokenizer(**dict(tokenizer_type="NullTokenizer", vocab_size=10))
    reward = build_reward("exact_match", eos_id=null.eos_id, tokenizer=null)
    assert _score(reward, [[4, 5, 9], [4, 6, 9]], " 4 5 ") == [1.0, 0.0]
    no_tokenizer = build_reward("exact_match", eos_id=EOS)
    with pytest.raises(ValueError, match=r"'exact_match' \(--reward-fn\) raised on sample 0: "
                                         r"ValueError: exact_match against a text answer needs a tokenizer"):
        _score(no_tokenizer, [[4]], "4")
    with pytest.raises(ValueError, match=r"--reward-fn exact_match needs the EOS id"):
        build_reward("exact_match")


def test_synthetic_retrieval_reward_on_the_synthetic_task():
    task = KeyValueRetrievalTask(vocab_size=500, prompt_length=2048, num_records=16, value_length=4)
    prompt_P, answer_A = task.sample(11)
    reward = build_reward("synthetic_retrieval")
    wrong_A = answer_A.clone()
    wrong_A[1] = task.content_ids[0] if wrong_A[1] != task.content_ids[0] else task.content_ids[1]
    responses = [answer_A, wrong_A, answer_A[:-1], answer_A[:2]]
    rewards_G = score_group(reward, prompt_P, responses, answer_A.tolist(), None)
    assert rewards_G.dtype == torch.float32 and rewards_G.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_synthetic_retrieval_partial_credit():
    reward = build_reward("synthetic_retrieval", partial_credit=0.5)
    answer = [4, 5, 6, 7, EOS]
    responses = [[4, 5, 6, 7, EOS], [4, 5, 6, 7], [4, 5, 8, 7, EOS], [8, 5, 6, 7, EOS], [4, 5, 6, 7, 7]]
    assert _score(reward, responses, answer) == [1.0, 0.5, 0.25, 0.0, 0.5]
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match=r"--reward-partial-credit must be in \[0, 1\)"):
            build_reward("synthetic_retrieval", partial_credit=bad)
    with pytest.raises(ValueError, match=r"raised on sample 0: ValueError: synthetic_retrieval needs the answer ids"):
        _score(reward, [[4]], None)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = "longstraw_user_reward_mod"
    (tmp_path / f"{name}.py").write_text(
        "import math\n"
        "def length_reward(prompt_ids, response_ids, answer, metadata):\n"
        "    return float(len(response_ids)) + metadata['bonus']\n"
        "class Holder:\n"
        "    @staticmethod\n"
        "    def nan(prompt_ids, response_ids, answer, metadata):\n"
        "        return math.nan\n"
        "NOT_CALLABLE = 3\n")
    (tmp_path / "longstraw_broken_mod.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in (name, "longstraw_broken_mod"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    return name


def test_user_reward_by_module_function(user_module):
    reward = build_reward(f"{user_module}:length_reward")
    assert reward.name == f"{user_module}:length_reward"
    rewards_G = score_group(reward, PROMPT, [[1, 2], [1, 2, 3]], None, {"bonus": 0.5})
    assert rewards_G.tolist() == [2.5, 3.5]
    nan = build_reward(f"{user_module}:Holder.nan")
    with pytest.raises(ValueError, match=rf"'{user_module}:Holder.nan' \(--reward-fn\) returned nan "
                                         r"for sample 0 of data.jsonl:4; a reward must be finite"):
        score_group(nan, PROMPT, [[1]], source="data.jsonl:4")


def test_user_reward_module_in_the_working_directory(tmp_path, monkeypatch):
    """``module:function`` finds a module in the working directory (as ``python -m`` would), also
    when the process was started as ``python path/to/train_grpo.py`` from there."""
    name = "longstraw_cwd_reward_mod"
    (tmp_path / f"{name}.py").write_text("def one(prompt_ids, response_ids, answer, metadata):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    monkeypatch.delitem(sys.modules, name, raising=False)
    assert _score(build_reward(f"{name}:one"), [[1]], None) == [1.0]


@pytest.mark.parametrize("spec, message", [
    ("no_such_reward", r"--reward-fn 'no_such_reward': unknown reward; registered: .*exact_match, "
                       r"synthetic_retrieval \(or give module:function\)"),
    ("longstraw_missing_mod:f", r"--reward-fn 'longstraw_missing_mod:f': no module named 'longstraw_missing_mod'"),
    ("longstraw_user_reward_mod:nope", r"--reward-fn 'longstraw_user_reward_mod:nope': module "
                                       r"'longstraw_user_reward_mod' has no attribute 'nope'"),
    ("longstraw_user_reward_mod:NOT_CALLABLE", r"--reward-fn 'longstraw_user_reward_mod:NOT_CALLABLE': "
                                               r"'NOT_CALLABLE' is not callable"),
    ("longstraw_broken_mod:f", r"--reward-fn 'longstraw_broken_mod:f': importing 'longstraw_broken_mod' "
                               r"failed: RuntimeError: boom at import"),
    ("longstraw_user_reward_mod:", r"--reward-fn 'longstraw_user_reward_mod:': expected module:function"),
    ("", r"--reward-fn must name a reward, got ''"),
])
def test_reward_fn_errors_name_the_flag(user_module, spec, message):
    with pytest.raises(ValueError, match=message):
        build_reward(spec)


def test_register_reward(monkeypatch):
    monkeypatch.setattr("megatron_longstraw.rewards.registry.REWARDS", dict(REWARDS))

    @register_reward("always_one")
    def always_one(context):
        return lambda prompt_ids, response_ids, answer, metadata: 1

    assert _score(build_reward("always_one"), [[1], [2]], None) == [1.0, 1.0]
    with pytest.raises(ValueError, match=r"a reward named 'always_one' is already registered"):
        register_reward("always_one")(always_one)


def test_score_group_errors_and_result_types():
    def boom(prompt_ids, response_ids, answer, metadata):
        if response_ids.numel() > 1:
            raise KeyError("missing")
        return 0.0

    with pytest.raises(ValueError, match=r"reward function 'test_score_group_errors_and_result_types.<locals>.boom' "
                                         r"\(--reward-fn\) raised on sample 1: KeyError: 'missing'") as info:
        _score(boom, [[1], [1, 2]], None)
    assert isinstance(info.value.__cause__, KeyError)

    for bad, shown in (("1.0", "str"), (None, "NoneType"), (torch.ones(2), r"an array of shape \(2,\)")):
        with pytest.raises(ValueError, match=rf"returned {shown}.* for sample 0; a reward must be a number"):
            _score(lambda *args, bad=bad: bad, [[1]], None)
    with pytest.raises(ValueError, match=r"returned -inf for sample 0; a reward must be finite"):
        _score(lambda *args: -math.inf, [[1]], None)
    ok = [torch.tensor(0.25), np.float32(0.5), 1, True]
    assert _score(lambda p, r, a, m: ok[int(r[0])], [[0], [1], [2], [3]], None) == [0.25, 0.5, 1.0, 1.0]


def test_score_group_padded_responses():
    reward = build_reward("exact_match", eos_id=EOS)
    responses_GT = torch.tensor([[4, 5, EOS, 0], [4, 5, 5, 5], [4, 5, 0, 0]])
    lengths_G = torch.tensor([3, 4, 2])
    seen = []
    score_group(lambda p, r, a, m: seen.append(r.tolist()) or 0.0, PROMPT, responses_GT,
                lengths_G=lengths_G)
    assert seen == [[4, 5, EOS], [4, 5, 5, 5], [4, 5]]
    assert _score(reward, responses_GT, [4, 5, EOS], lengths_G=lengths_G) == [1.0, 0.0, 1.0]
