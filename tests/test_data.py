"""Data: Megatron-Core tokenizers, JSONL prompts, the synthetic retrieval task, external
rollouts; every error names file and line; resumed positions continue exactly."""

import json
import re

import pytest
import torch

from megatron_longstraw.data.external_rollouts import ExternalRolloutDataset
from megatron_longstraw.data.position import EpochOrder
from megatron_longstraw.data.prompts import PromptDataset, resolve_max_prompt_length
from megatron_longstraw.data.synthetic import (MIN_VOCAB_SIZE, KeyValueRetrievalTask,
                                               SyntheticRetrievalDataset)
from megatron_longstraw.data.tokenizer import build_tokenizer

WORDS = "the quick brown fox jumps over lazy dog hello world answer is".split()


def _save_hf_tokenizer(folder, eos=True):
    """A tiny WordLevel tokenizer (adds <bos> around a text) saved as a transformers folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<unk>", "<bos>", "<eos>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    special = dict(unk_token="<unk>", bos_token="<bos>")
    if eos:
        special["eos_token"] = "<eos>"
    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _save_hf_tokenizer(tmp_path_factory.mktemp("hf_tokenizer"))


@pytest.fixture(scope="module")
def tok(hf_dir):
    return build_tokenizer("HuggingFaceTokenizer", str(hf_dir))


def _write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                            for line in lines))
    return path


# --- tokenizer ----------------------------------------------------------------------------------

def test_huggingface_tokenizer_through_megatron(tok, hf_dir):
    from megatron.core.tokenizers.text.text_tokenizer import MegatronTokenizerText

    assert isinstance(tok.megatron, MegatronTokenizerText)
    assert tok.vocab_size == 3 + len(WORDS) and tok.eos_id == 2
    ids = tok.tokenize("hello world")
    assert ids == [1, 3 + WORDS.index("hello"), 3 + WORDS.index("world")]
    assert tok.tokenize("hello world", add_special_tokens=False) == ids[1:]
    assert tok.detokenize(ids[1:] + [tok.eos_id]) == "hello world <eos>"
    assert tok.detokenize(torch.tensor(ids + [tok.eos_id]), skip_special_tokens=True) == "hello world"
    by_file = build_tokenizer(**dict(tokenizer_type="HuggingFaceTokenizer",
                                   tokenizer_model=str(hf_dir / "tokenizer.json")))
    assert by_file.tokenize("hello world") == ids


def test_null_tokenizer_through_megatron():
    null = build_tokenizer("NullTokenizer", vocab_size=100)
    assert (null.vocab_size, null.eos_id) == (100, 99)
    assert null.tokenize(" 1 2\n 3  4 ") == [1, 2, 3, 4] and null.tokenize("") == []
    assert null.detokenize([5, 6]) == "5 6"
    with pytest.raises(ValueError, match="NullTokenizer text must be whitespace-separated integer ids"):
        null.tokenize("1 two")


@pytest.mark.parametrize("args, message", [
    (dict(tokenizer_type="GPT2BPETokenizer"),
     r"--tokenizer-type 'GPT2BPETokenizer' is not supported; supported: HuggingFaceTokenizer"),
    (dict(tokenizer_type="NullTokenizer"), r"--tokenizer-type NullTokenizer needs --vocab-size >= 2, got None"),
    (dict(tokenizer_type="HuggingFaceTokenizer"), r"--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model$"),
    (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/nonexistent/tok"),
     r"--tokenizer-model /nonexistent/tok: no such file or folder"),
])
def test_tokenizer_flag_errors(args, message):
    with pytest.raises(ValueError, match=message):
        build_tokenizer(**args)


def test_tokenizer_unusable_folder_and_missing_eos(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"--tokenizer-model .*/empty: cannot load a HuggingFaceTokenizer"):
        build_tokenizer(**dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "empty")))
    no_eos = _save_hf_tokenizer(tmp_path / "no_eos", eos=False)
    with pytest.raises(ValueError, match=r"--tokenizer-model .*/no_eos: the tokenizer defines no EOS token"):
        build_tokenizer(**dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(no_eos)))


def _sentencepiece_installed():
    try:
        import sentencepiece  # noqa: F401
        return True
    except ImportError:
        return False


@pytest.mark.skipif(not _sentencepiece_installed(),
                    reason="the sentencepiece package is not installed in .venv")
def test_sentencepiece_tokenizer_through_megatron(tmp_path):
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))) * 20)
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=3 + len(WORDS), model_type="word", eos_id=2,
                                   bos_id=1, unk_id=0, pad_id=-1, minloglevel=2)
    sp = build_tokenizer(**dict(tokenizer_type="SentencePieceTokenizer",
                              tokenizer_model=str(tmp_path / "sp.model")))
    assert sp.eos_id == 2 and sp.vocab_size == 3 + len(WORDS)
    assert sp.detokenize(sp.tokenize("hello world")) == "hello world"


@pytest.mark.skipif(_sentencepiece_installed(), reason="sentencepiece is installed")
def test_sentencepiece_missing_package_is_one_clear_error(tmp_path):
    model = tmp_path / "sp.model"
    model.write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"--tokenizer-type SentencePieceTokenizer needs the "
                                         r"sentencepiece package, which is not installed"):
        build_tokenizer(**dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(model)))


# --- prompts ------------------------------------------------------------------------------------

def test_prompt_dataset_reads_text_and_ids(tmp_path, tok):
    path = _write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "hello world", "answer": "dog", "metadata": {"k": 1}},
        "",
        {"prompt_ids": [4, 5, 6], "answer": [7, 2]},
    ])
    data = PromptDataset(str(path), tok, shuffle=False)
    assert len(data) == 2
    first, second = next(data), next(data)
    assert first.prompt_ids_P.tolist() == tok.tokenize("hello world")
    assert (first.answer, first.metadata, first.source) == ("dog", {"k": 1}, f"{path}:1")
    assert second.prompt_ids_P.dtype == torch.long and second.prompt_ids_P.tolist() == [4, 5, 6]
    assert (second.answer, second.metadata, second.source) == ([7, 2], None, f"{path}:3")
    assert next(data).source == f"{path}:1"  # second epoch


PROMPT_ERRORS = [
    ('{"prompt": "hello",', r"invalid JSON \(.* at column \d+\)"),
    ('[1, 2]', r"expected a JSON object, got list"),
    ({"answer": "x"}, r"a record needs exactly one of 'prompt' or 'prompt_ids', it has neither"),
    ({"prompt": "hello", "prompt_ids": [1]}, r"a record needs exactly one of .*, it has both"),
    ({"prompt": 5}, r"'prompt' must be a string, got int"),
    ({"prompt": ""}, r"'prompt' is empty"),
    ({"prompt_ids": "1 2"}, r"'prompt_ids' must be a list of token ids, got str"),
    ({"prompt_ids": []}, r"'prompt_ids' is empty"),
    ({"prompt_ids": [1, 2.5]}, r"'prompt_ids' holds 2.5; token ids must be integers"),
    ({"prompt_ids": [1, True]}, r"'prompt_ids' holds True; token ids must be integers"),
    ({"prompt_ids": [1, 15]}, r"'prompt_ids' holds token id 15, outside the vocabulary \[0, 15\)"),
    ({"prompt_ids": [-1, 3]}, r"'prompt_ids' holds token id -1, outside the vocabulary"),
    ({"prompt": "hi", "anwser": "x"}, r"unknown key 'anwser' \(expected prompt, prompt_ids, answer, metadata\)"),
    ({"prompt": "hi", "answer": 3}, r"'answer' must be a string or a list of token ids, got int"),
    ({"prompt": "hi", "answer": [99]}, r"'answer' holds token id 99, outside the vocabulary"),
    ({"prompt": "hi", "metadata": [1]}, r"'metadata' must be a JSON object, got list"),
    ({"prompt_ids": list(range(9))}, r"prompt has 9 tokens, more than the maximum prompt length 8"),
]


@pytest.mark.parametrize("bad, message", PROMPT_ERRORS)
def test_prompt_errors_name_file_and_line(tmp_path, tok, bad, message):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello"}, "", bad])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:3: {message}"):
        PromptDataset(str(path), tok, max_prompt_length=8)


def test_prompt_lazy_validation_and_file_errors(tmp_path, tok):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt_ids": [3]}, {"prompt": 1}])
    data = PromptDataset(str(path), tok, validate=False, shuffle=False)
    next(data)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:2: 'prompt' must be a string"):
        next(data)
    assert data.index == 1  # a failing item leaves the position on it
    text = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": "hello"}])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(text))}:1: 'prompt' is text but no tokenizer"):
        PromptDataset(str(text), vocab_size=10)
    with pytest.raises(ValueError, match=r"^--prompt-data /nonexistent.jsonl: no such file"):
        PromptDataset("/nonexistent.jsonl", tok)
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match=r"--prompt-data .*e.jsonl: the file holds no records"):
        PromptDataset(str(empty), tok)
    with pytest.raises(ValueError, match=r"cannot be checked without a tokenizer or a vocabulary size"):
        PromptDataset(str(path))


def test_null_tokenizer_text_prompt_errors(tmp_path):
    null = build_tokenizer(**dict(tokenizer_type="NullTokenizer", vocab_size=10))
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1 2"}, {"prompt": "1 x"}, {"prompt": "1 12"}])
    data = PromptDataset(str(path), null, validate=False, shuffle=False)
    assert next(data).prompt_ids_P.tolist() == [1, 2]
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}:2: cannot tokenize 'prompt': NullTokenizer"):
        data[1]
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}:3: 'prompt' holds token id 12, outside"):
        data[2]


def test_resolve_max_prompt_length():
    assert resolve_max_prompt_length() is None
    assert resolve_max_prompt_length(100) == 100
    assert resolve_max_prompt_length(None, 1000, 200) == 800
    assert resolve_max_prompt_length(700, 1000, 200) == 700
    with pytest.raises(ValueError, match=r"--max-prompt-length 900 plus --max-response-length 200 "
                                         r"exceeds the model's 1000 positions"):
        resolve_max_prompt_length(900, 1000, 200)
    with pytest.raises(ValueError, match=r"--max-response-length 1000 leaves no room for a prompt"):
        resolve_max_prompt_length(None, 1000, 1000)
    with pytest.raises(ValueError, match=r"--max-prompt-length must be >= 1, got 0"):
        resolve_max_prompt_length(0)


def _sources(data, count):
    return [next(data).source for _ in range(count)]


def test_prompt_resume_continues_with_the_next_prompt(tmp_path, tok):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt_ids": [3 + i]} for i in range(7)])
    uninterrupted = _sources(PromptDataset(str(path), tok, seed=5), 20)
    epochs = [uninterrupted[0:7], uninterrupted[7:14]]
    assert all(sorted(e) == sorted(f"{path}:{i + 1}" for i in range(7)) for e in epochs)
    assert epochs[0] != epochs[1]  # reshuffled each epoch
    assert _sources(PromptDataset(str(path), tok, seed=5), 20) == uninterrupted
    for k in (0, 3, 7, 10):
        data = PromptDataset(str(path), tok, seed=5)
        assert _sources(data, k) == uninterrupted[:k]
        state = json.loads(json.dumps(data.state_dict()))
        assert (state["epoch"], state["index"]) == divmod(k, 7)
        resumed = PromptDataset(str(path), tok, seed=5)
        resumed.load_state_dict(state)
        assert _sources(resumed, 20 - k) == uninterrupted[k:]


def test_position_state_mismatch_is_refused():
    order = EpochOrder(5, seed=1)
    with pytest.raises(ValueError, match=r"data position was saved with --seed 2, this run uses --seed 1"):
        order.load_state_dict(EpochOrder(5, seed=2).state_dict())
    with pytest.raises(ValueError, match=r"data position was saved for 6 items, this dataset has 5"):
        order.load_state_dict(EpochOrder(6, seed=1).state_dict())
    with pytest.raises(ValueError, match=r"data position state lacks index"):
        order.load_state_dict(dict(epoch=0, seed=1, num_items=5, shuffle=True))
    with pytest.raises(ValueError, match=r"out of range for 5 items"):
        order.load_state_dict(dict(epoch=0, index=5, seed=1, num_items=5, shuffle=True))


# --- synthetic task -----------------------------------------------------------------------------

def test_synthetic_sample_is_deterministic_and_laid_out_as_documented():
    kwargs = dict(vocab_size=1000, prompt_length=4096, num_records=8, key_length=2,
                  value_length=3, vocab_lo=100, vocab_hi=600, eos_id=999, seed=3)
    task = KeyValueRetrievalTask(**kwargs)
    prompt_P, answer_A = task.sample(7)
    again_P, again_A = KeyValueRetrievalTask(**kwargs).sample(7)
    assert torch.equal(prompt_P, again_P) and torch.equal(answer_A, again_A)
    assert not torch.equal(task.sample(8)[0], prompt_P)
    assert not torch.equal(KeyValueRetrievalTask(**{**kwargs, "seed": 4}).sample(7)[0], prompt_P)

    assert prompt_P.shape == (4096,) and prompt_P.dtype == torch.long and answer_A.dtype == torch.long
    assert (task.record_id, task.sep_id, task.end_id, task.query_id) == (100, 101, 102, 103)
    assert bool(((prompt_P >= 100) & (prompt_P < 600)).all())
    ids = prompt_P.tolist()
    assert ids[-4] == task.query_id and ids[-1] == task.sep_id
    key = ids[-3:-1]
    records = [i for i, t in enumerate(ids) if t == task.record_id]
    assert len(records) == 8 and ids.count(task.query_id) == 1
    keys = [tuple(ids[r + 1:r + 3]) for r in records]
    assert len(set(keys)) == 8
    for r in records:
        assert ids[r + 3] == task.sep_id and ids[r + 7] == task.end_id
    hit = records[keys.index(tuple(key))]
    assert answer_A.tolist() == ids[hit + 4:hit + 7] + [999]
    assert task.generate(7)[2]["record_position"] == hit


def test_synthetic_task_at_minimum_vocab_and_errors():
    task = KeyValueRetrievalTask(vocab_size=MIN_VOCAB_SIZE, prompt_length=64, num_records=4,
                                 key_length=2, value_length=2)
    prompt_P, answer_A = task.sample(0)
    assert prompt_P.numel() == 64 and answer_A[-1].item() == MIN_VOCAB_SIZE - 1
    assert bool((prompt_P < MIN_VOCAB_SIZE - 1).all())  # EOS never in the prompt
    with pytest.raises(ValueError, match=rf"vocab_size must be >= {MIN_VOCAB_SIZE}, got 7"):
        KeyValueRetrievalTask(vocab_size=7, prompt_length=64)
    with pytest.raises(ValueError, match=r"prompt_length 20 is too short for 2 records of 9 tokens"):
        KeyValueRetrievalTask(vocab_size=100, prompt_length=20, num_records=2)
    with pytest.raises(ValueError, match=r"3 content ids and key_length 1 cannot make 4 distinct keys"):
        KeyValueRetrievalTask(vocab_size=8, prompt_length=64, num_records=4, key_length=1)
    with pytest.raises(ValueError, match=r"eos_id 2 collides with the marker ids \[0, 4\)"):
        KeyValueRetrievalTask(vocab_size=100, prompt_length=64, eos_id=2)
    with pytest.raises(ValueError, match=r"vocabulary slice \[50, 200\) must lie within \[0, 100\)"):
        KeyValueRetrievalTask(vocab_size=100, prompt_length=64, vocab_lo=50, vocab_hi=200)


@pytest.mark.parametrize("num_samples", [None, 5])
def test_synthetic_dataset_resume(num_samples):
    task = KeyValueRetrievalTask(vocab_size=64, prompt_length=128, num_records=2)

    def take(data, count):
        return [(item.source, item.prompt_ids_P.tolist(), item.answer) for item in
                (next(data) for _ in range(count))]

    uninterrupted = take(SyntheticRetrievalDataset(task, num_samples, seed=9), 12)
    if num_samples:
        assert sorted(s for s, _, _ in uninterrupted[:5]) == [f"synthetic:{i}" for i in range(5)]
    else:
        assert [s for s, _, _ in uninterrupted] == [f"synthetic:{i}" for i in range(12)]
    data = SyntheticRetrievalDataset(task, num_samples, seed=9)
    take(data, 7)
    resumed = SyntheticRetrievalDataset(task, num_samples, seed=9)
    resumed.load_state_dict(data.state_dict())
    assert take(resumed, 5) == uninterrupted[7:]


# --- external rollouts --------------------------------------------------------------------------

def test_external_rollouts_read_and_score(tmp_path, tok):
    from megatron_longstraw.rewards import build_reward

    hello, dog = 3 + WORDS.index("hello"), 3 + WORDS.index("dog")
    path = _write_jsonl(tmp_path / "r.jsonl", [
        {"prompt": "the answer is", "responses": ["dog", "fox"], "answer": "dog"},
        {"prompt_ids": [hello], "responses": [[dog, 2], [dog]], "rewards": [0.5, -1], "metadata": {}},
    ])
    data = ExternalRolloutDataset(str(path), tok, num_generations=2, shuffle=False)
    first, second = next(data), next(data)
    assert first.prompt_ids_P.tolist() == tok.tokenize("the answer is")
    assert [r.tolist() for r in first.responses] == [[dog, 2], [3 + WORDS.index("fox"), 2]]
    assert first.rewards_G is None
    reward = build_reward("exact_match", eos_id=tok.eos_id, tokenizer=tok)
    assert first.score(reward).tolist() == [1.0, 0.0]
    assert [r.tolist() for r in second.responses] == [[dog, 2], [dog]]  # ids verbatim
    assert second.score(reward).tolist() == [0.5, -1.0]
    assert (second.metadata, second.source) == ({}, f"{path}:2")


ROLLOUT_ERRORS = [
    ({"prompt": "hi"}, r"missing 'responses'"),
    ({"prompt": "hi", "responses": "dog"}, r"'responses' must be a list, got str"),
    ({"prompt": "hi", "responses": ["dog"]}, r"'responses' has 1 entries, --num-generations is 2"),
    ({"prompt": "hi", "responses": ["dog", "", ]}, r"'responses\[1\]' is empty"),
    ({"prompt": "hi", "responses": ["dog", []]}, r"'responses\[1\]' is empty"),
    ({"prompt": "hi", "responses": ["dog", 3]}, r"'responses\[1\]' must be a text or a list of token ids, got int"),
    ({"prompt": "hi", "responses": [[3], [3, 40]]},
     r"'responses\[1\]' holds token id 40, outside the vocabulary \[0, 15\)"),
    ({"prompt": "hi", "responses": [[3], [3] * 7]},
     r"'responses\[1\]' has 7 tokens, more than --max-response-length 6"),
    ({"prompt": "hi", "responses": [[3], [4]], "rewards": [1.0]}, r"'rewards' has 1 entries, --num-generations is 2"),
    ('{"prompt": "hi", "responses": [[3], [4]], "rewards": [1.0, NaN]}', r"reward 1 is nan; rewards must be finite"),
    ('{"prompt": "hi", "responses": [[3], [4]], "rewards": [Infinity, 1]}', r"reward 0 is inf; rewards must be finite"),
    ({"prompt": "hi", "responses": [[3], [4]], "rewards": [1, "1"]}, r"reward 1 is '1'; rewards must be numbers"),
    ({"prompt": "hi", "responses": [[3], [4]], "rewards": 1}, r"'rewards' must be a list of numbers, got int"),
    ({"prompt_ids": [3, 99], "responses": [[3], [4]]}, r"'prompt_ids' holds token id 99, outside"),
    ({"prompt": "hi", "responses": [[3], [4]], "extra": 1}, r"unknown key 'extra'"),
    ('{"prompt": "hi", "responses": [[3], [4]]', r"invalid JSON"),
]


@pytest.mark.parametrize("bad, message", ROLLOUT_ERRORS)
def test_external_rollout_errors_name_file_and_line(tmp_path, tok, bad, message):
    path = _write_jsonl(tmp_path / "r.jsonl", [{"prompt": "hi", "responses": [[3], [4]]}, bad])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:2: {message}"):
        ExternalRolloutDataset(str(path), tok, num_generations=2, max_response_length=6)


def test_external_rollout_text_needs_tokenizer_and_resume(tmp_path, tok):
    path = _write_jsonl(tmp_path / "r.jsonl", [{"prompt_ids": [3], "responses": ["dog", [4]]}])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:1: 'responses\[0\]' is text but no tokenizer"):
        ExternalRolloutDataset(str(path), num_generations=2, vocab_size=15)
    with pytest.raises(ValueError, match=r"^--external-rollouts /nonexistent.jsonl: no such file"):
        ExternalRolloutDataset("/nonexistent.jsonl", tok, num_generations=2)

    path = _write_jsonl(tmp_path / "many.jsonl",
                        [{"prompt_ids": [3 + i], "responses": [[4], [5]]} for i in range(5)])
    uninterrupted = _sources(ExternalRolloutDataset(str(path), tok, num_generations=2, seed=2), 13)
    data = ExternalRolloutDataset(str(path), tok, num_generations=2, seed=2)
    _sources(data, 6)
    resumed = ExternalRolloutDataset(str(path), tok, num_generations=2, seed=2)
    resumed.load_state_dict(data.state_dict())
    assert _sources(resumed, 7) == uninterrupted[6:]
