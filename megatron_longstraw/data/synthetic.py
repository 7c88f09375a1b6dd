"""Built-in synthetic long-context task: key -> value retrieval in token-id space.

No tokenizer is involved: the task works with any vocabulary of at least ``MIN_VOCAB_SIZE``
ids. The ids it uses come from a slice ``[vocab_lo, vocab_hi)`` of the vocabulary:

=====================  =====================================================================
id                     role
=====================  =====================================================================
``vocab_lo + 0``       ``RECORD``: opens a record
``vocab_lo + 1``       ``SEP``: separates a key from its value (and ends the query)
``vocab_lo + 2``       ``END``: closes a record
``vocab_lo + 3``       ``QUERY``: opens the query after the haystack
``vocab_lo + 4`` ...   content ids (keys, values, filler): the rest of the slice, minus EOS
``eos_id``             ends the answer (default ``vocab_size - 1``, Megatron's NullTokenizer
                       EOD; pass the model tokenizer's EOS for a real model)
=====================  =====================================================================

A prompt of exactly ``prompt_length`` tokens is::

    filler ... RECORD k_1..k_K SEP v_1..v_V END filler ... (num_records records) ... filler
    QUERY k_1..k_K SEP

with the records (distinct keys of ``key_length`` ids, values of ``value_length`` ids, all
uniform over the content ids) inserted at uniform random positions of uniform random filler,
and the query asking for one record's key. The answer is that record's value followed by EOS.
``num_records=1`` is a single-needle lookup. Difficulty knobs: ``prompt_length``,
``num_records``, ``value_length`` (and ``key_length``), and the vocabulary slice.

Sample ``i`` depends only on the task's arguments, ``seed`` and ``i`` (numpy PCG64 seeded with
``[seed, i]``): ``task.sample(i)`` is reproducible anywhere, in any order.
"""

import numpy as np
import torch

from megatron_longstraw.data.items import PromptItem
from megatron_longstraw.data.position import EpochOrder, PositionedDataset

NUM_SPECIAL_IDS = 4
RECORD_OFFSET, SEP_OFFSET, END_OFFSET, QUERY_OFFSET = range(NUM_SPECIAL_IDS)
MIN_VOCAB_SIZE = 8  # 4 markers + at least 3 content ids + EOS


class KeyValueRetrievalTask:
    """Generator of key -> value retrieval prompts (see the module docstring)."""

    def __init__(self, vocab_size: int, prompt_length: int, num_records: int = 16,
                 key_length: int = 2, value_length: int = 4, vocab_lo: int = 0,
                 vocab_hi: int | None = None, eos_id: int | None = None, seed: int = 0):
        if vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(f"synthetic task: vocab_size must be >= {MIN_VOCAB_SIZE}, "
                             f"got {vocab_size}")
        vocab_hi = vocab_size if vocab_hi is None else vocab_hi
        eos_id = vocab_size - 1 if eos_id is None else eos_id
        if not 0 <= vocab_lo < vocab_hi <= vocab_size:
            raise ValueError(f"synthetic task: vocabulary slice [{vocab_lo}, {vocab_hi}) must lie "
                             f"within [0, {vocab_size})")
        if not 0 <= eos_id < vocab_size:
            raise ValueError(f"synthetic task: eos_id {eos_id} is outside [0, {vocab_size})")
        if vocab_lo <= eos_id < vocab_lo + NUM_SPECIAL_IDS:
            raise ValueError(f"synthetic task: eos_id {eos_id} collides with the marker ids "
                             f"[{vocab_lo}, {vocab_lo + NUM_SPECIAL_IDS})")
        for name, value in (("num_records", num_records), ("key_length", key_length),
                            ("value_length", value_length)):
            if value < 1:
                raise ValueError(f"synthetic task: {name} must be >= 1, got {value}")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"synthetic task: seed must be a non-negative integer, got {seed!r}")
        content_ids = np.arange(vocab_lo + NUM_SPECIAL_IDS, vocab_hi, dtype=np.int64)
        content_ids = content_ids[content_ids != eos_id]
        if content_ids.size < 2:
            raise ValueError(f"synthetic task: vocabulary slice [{vocab_lo}, {vocab_hi}) leaves "
                             f"{content_ids.size} content ids after the markers and EOS; need >= 2")
        if content_ids.size ** key_length < num_records:
            raise ValueError(f"synthetic task: {content_ids.size} content ids and key_length "
                             f"{key_length} cannot make {num_records} distinct keys")
        record_length = key_length + value_length + 3
        minimum = num_records * record_length + key_length + 2
        if prompt_length < minimum:
            raise ValueError(f"synthetic task: prompt_length {prompt_length} is too short for "
                             f"{num_records} records of {record_length} tokens and the query; "
                             f"needs >= {minimum}")
        self.vocab_size = vocab_size
        self.prompt_length = prompt_length
        self.num_records = num_records
        self.key_length = key_length
        self.value_length = value_length
        self.vocab_lo, self.vocab_hi = vocab_lo, vocab_hi
        self.eos_id = eos_id
        self.seed = seed
        self.record_id = vocab_lo + RECORD_OFFSET
        self.sep_id = vocab_lo + SEP_OFFSET
        self.end_id = vocab_lo + END_OFFSET
        self.query_id = vocab_lo + QUERY_OFFSET
        self.content_ids = content_ids
        self.filler_length = prompt_length - minimum

    def variant(self, *, prompt_length: int | None = None, seed: int | None = None) -> "KeyValueRetrievalTask":
        """The same task at another prompt length and/or seed (a curriculum stage, held-out prompts)."""
        return KeyValueRetrievalTask(self.vocab_size, self.prompt_length if prompt_length is None else prompt_length,
                                     num_records=self.num_records, key_length=self.key_length,
                                     value_length=self.value_length, vocab_lo=self.vocab_lo, vocab_hi=self.vocab_hi,
                                     eos_id=self.eos_id, seed=self.seed if seed is None else seed)

    def _distinct_keys(self, rng: np.random.Generator) -> np.ndarray:
        num_content = self.content_ids.size
        keys, seen = [], set()
        while len(keys) < self.num_records:
            draw = rng.integers(0, num_content, size=(self.num_records - len(keys), self.key_length))
            for row in map(tuple, draw.tolist()):
                if row not in seen:
                    seen.add(row)
                    keys.append(row)
        return self.content_ids[np.array(keys, dtype=np.int64)]

    def generate(self, index: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """``(prompt_ids_P, answer_ids_A, metadata)`` of sample ``index``; metadata records the
        queried record and where it starts in the prompt."""
        if index < 0:
            raise ValueError(f"synthetic task: sample index must be >= 0, got {index}")
        rng = np.random.default_rng([self.seed, index])
        num_content = self.content_ids.size
        keys_NK = self._distinct_keys(rng)
        values_NV = self.content_ids[rng.integers(0, num_content,
                                                  size=(self.num_records, self.value_length))]
        filler_F = self.content_ids[rng.integers(0, num_content, size=self.filler_length)]
        cuts_N = np.sort(rng.integers(0, self.filler_length + 1, size=self.num_records))
        query = int(rng.integers(0, self.num_records))

        prompt_P = np.empty(self.prompt_length, dtype=np.int64)
        out = prev = 0
        query_position = -1
        for r, cut in enumerate(cuts_N.tolist()):
            prompt_P[out:out + cut - prev] = filler_F[prev:cut]
            out += cut - prev
            prev = cut
            if r == query:
                query_position = out
            record = ([self.record_id], keys_NK[r], [self.sep_id], values_NV[r], [self.end_id])
            for piece in record:
                prompt_P[out:out + len(piece)] = piece
                out += len(piece)
        prompt_P[out:out + self.filler_length - prev] = filler_F[prev:]
        out += self.filler_length - prev
        for piece in ([self.query_id], keys_NK[query], [self.sep_id]):
            prompt_P[out:out + len(piece)] = piece
            out += len(piece)
        assert out == self.prompt_length
        answer_A = np.concatenate([values_NV[query], [self.eos_id]])
        metadata = dict(task="synthetic_retrieval", index=index, query_record=query,
                        record_position=query_position)
        return torch.from_numpy(prompt_P), torch.from_numpy(answer_A), metadata

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(prompt_ids_P, answer_ids_A)`` of sample ``index``: the prompt (1-D LongTensor of
        ``prompt_length`` ids) and the queried value followed by EOS."""
        prompt_ids_P, answer_ids_A, _ = self.generate(index)
        return prompt_ids_P, answer_ids_A


class SyntheticRetrievalDataset(PositionedDataset):
    """``KeyValueRetrievalTask`` samples as ``PromptItem``s (answer = value ids + EOS as a list),
    with the same checkpointable position as the JSONL datasets.

    ``num_samples=None``: an unbounded stream of samples 0, 1, 2, ... (epoch stays 0);
    otherwise samples ``0..num_samples-1``, reshuffled each epoch from ``seed``.
    """

    def __init__(self, task: KeyValueRetrievalTask, num_samples: int | None = None,
                 seed: int = 0, shuffle: bool = True):
        self.task = task
        self.num_samples = num_samples
        self.order = EpochOrder(num_samples, seed, shuffle and num_samples is not None)

    def __len__(self) -> int:
        if self.num_samples is None:
            raise TypeError("an unbounded synthetic dataset (num_samples=None) has no length")
        return self.num_samples

    def __getitem__(self, i: int) -> PromptItem:
        """Sample ``i``."""
        if self.num_samples is not None and not 0 <= i < self.num_samples:
            raise IndexError(f"synthetic sample {i} is outside [0, {self.num_samples})")
        prompt_ids_P, answer_ids_A, metadata = self.task.generate(i)
        return PromptItem(prompt_ids_P=prompt_ids_P, answer=answer_ids_A.tolist(),
                          metadata=metadata, source=f"synthetic:{i}")
