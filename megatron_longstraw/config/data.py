"""Prompts, the tokenizer, the synthetic task and held-out evaluation (their flag groups)."""

from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional

from megatron_longstraw.config.node import ConfigNode

SYNTHETIC = "synthetic"
"""``--data-path`` of the built-in synthetic retrieval task."""


@dataclass(frozen=True)
class PromptLengthSchedule:
    """A prompt-length curriculum for the synthetic task (``--prompt-length-schedule``).

    ``"512:200,4096:200,32768"``: prompts of 512 tokens for the first 200 steps, 4,096 for the
    next 200, 32,768 from then on (the last stage takes no step count: it lasts to the end). The
    length is a function of the step alone, so a resumed run continues the schedule where it
    stopped.
    """

    stages: tuple[tuple[int, Optional[int]], ...]
    """``(prompt length, steps)`` per stage; the last stage's steps are ``None`` (to the end)."""

    FLAG: ClassVar[str] = "--prompt-length-schedule"

    @classmethod
    def parse(cls, text: str) -> "PromptLengthSchedule":
        """``"LENGTH:STEPS,...,LENGTH"``; ``ValueError`` naming the flag and the bad stage."""
        stages = []
        pieces = [p.strip() for p in text.split(",")]
        for i, piece in enumerate(pieces):
            length, _, steps = piece.partition(":")
            last = i == len(pieces) - 1
            try:
                length_value = int(length)
                steps_value = int(steps) if steps else None
            except ValueError:
                raise ValueError(f"{cls.FLAG} {text!r}: stage {piece!r} is not LENGTH:STEPS") from None
            if length_value < 1 or (steps_value is not None and steps_value < 1):
                raise ValueError(f"{cls.FLAG} {text!r}: stage {piece!r} needs a length and steps >= 1")
            if steps_value is None and not last:
                raise ValueError(f"{cls.FLAG} {text!r}: only the last stage may leave out its steps ({piece!r})")
            stages.append((length_value, steps_value))
        return cls(tuple(stages))

    def length_at(self, step: int) -> int:
        """The prompt length of 0-based step ``step`` (past the stages: the last one's)."""
        assert step >= 0, step
        for length, steps in self.stages:
            if steps is None or step < steps:
                return length
            step -= steps
        return self.stages[-1][0]

    @property
    def longest(self) -> int:
        """The longest stage's prompt length."""
        return max(length for length, _ in self.stages)


@dataclass(frozen=True)
class DataConfig(ConfigNode):
    """The prompts and their tokenizer."""

    TITLE: ClassVar[str] = "data"

    data_path: str = SYNTHETIC
    """JSONL prompts, or 'synthetic'."""

    max_prompt_length: Optional[int] = None
    """Longest prompt taken (default: the model's positions minus --max-response-length)."""

    synthetic_prompt_length: int = 256
    """Tokens of a synthetic retrieval prompt."""

    synthetic_num_records: int = 4
    """Key-value records hidden in a synthetic prompt."""

    synthetic_value_length: int = 1
    """Tokens of a synthetic record's value."""

    synthetic_vocab_size: Optional[int] = None
    """The task uses ids [0, N) only (markers, keys, values, filler); default: the model's."""

    prompt_length_schedule: Optional[str] = field(default=None, metadata={"metavar": "LENGTH:STEPS,...,LENGTH"})
    """Synthetic task curriculum, e.g. 512:200,4096:200,32768: each stage's prompt length for its
    steps, the last to the end (replaces --synthetic-prompt-length, which becomes its longest for
    the plan check; logged as curriculum/prompt_length; default: unset)."""

    tokenizer_type: Literal["NullTokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer"] = "NullTokenizer"
    """Megatron tokenizer (NullTokenizer: the data are token ids)."""

    tokenizer_model: Optional[str] = None
    """Tokenizer folder or file (every --tokenizer-type but NullTokenizer; default: unset)."""

    def check(self) -> None:
        if self.tokenizer_type != "NullTokenizer" and not self.tokenizer_model:
            raise ValueError(f"--tokenizer-type {self.tokenizer_type} needs --tokenizer-model")
        self.curriculum  # noqa: B018  (a schedule that does not parse is refused here)

    @property
    def synthetic(self) -> bool:
        """Whether the prompts are the built-in synthetic task's."""
        return self.data_path == SYNTHETIC

    @property
    def curriculum(self) -> Optional[PromptLengthSchedule]:
        """The parsed ``--prompt-length-schedule`` (``None`` without one)."""
        if self.prompt_length_schedule is None:
            return None
        return PromptLengthSchedule.parse(self.prompt_length_schedule)

    @property
    def longest_synthetic_prompt(self) -> int:
        """The longest synthetic prompt of the run: the schedule's longest stage, else
        ``--synthetic-prompt-length``."""
        curriculum = self.curriculum
        return curriculum.longest if curriculum is not None else self.synthetic_prompt_length

    @property
    def synthetic_length_flag(self) -> str:
        """The flag that sets ``longest_synthetic_prompt``."""
        return PromptLengthSchedule.FLAG if self.prompt_length_schedule is not None else "--synthetic-prompt-length"


@dataclass(frozen=True)
class EvaluationConfig(ConfigNode):
    """Held-out evaluation on the synthetic task."""

    TITLE: ClassVar[str] = "evaluation"

    eval_interval: int = 0
    """Every N steps, greedy and sampled reward on held-out synthetic prompts (eval/*); 0: never."""

    skip_train: bool = False
    """No training: evaluate the checkpoint (--load, or the newest in --save) on held-out synthetic
    prompts at --eval-prompt-lengths, print the eval/* figures and write them to
    <--wandb-save-dir>/eval_iter_<N>.json."""

    eval_prompts: int = 16
    """Held-out prompts per length (a multiple of the data-parallel size)."""

    eval_prompt_lengths: Optional[str] = None
    """Comma-separated prompt lengths to evaluate at (default: the training length, the
    schedule's last)."""

    def check(self) -> None:
        if self.eval_interval < 0:
            raise ValueError(f"--eval-interval must be >= 0, got {self.eval_interval}")
        self.given_lengths  # noqa: B018  (lengths that do not parse are refused here)

    @property
    def enabled(self) -> bool:
        """Whether the run evaluates (``--eval-interval`` or ``--skip-train``)."""
        return bool(self.eval_interval or self.skip_train)

    @property
    def given_lengths(self) -> Optional[list[int]]:
        """``--eval-prompt-lengths`` parsed (``None`` when unset)."""
        if self.eval_prompt_lengths is None:
            return None
        try:
            lengths = [int(x) for x in self.eval_prompt_lengths.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--eval-prompt-lengths {self.eval_prompt_lengths!r}: comma-separated integers") from None
        if not lengths or min(lengths) < 1:
            raise ValueError(f"--eval-prompt-lengths {self.eval_prompt_lengths!r}: lengths >= 1 needed")
        return lengths
