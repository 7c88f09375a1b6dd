"""A prompt-length curriculum for the synthetic task (``--prompt-length-schedule``).

``"512:200,4096:200,32768"``: prompts of 512 tokens for the first 200 steps, 4,096 for the next
200, 32,768 from then on (the last stage takes no step count: it lasts to the end). The length
is a function of the step alone, so a resumed run continues the schedule where it stopped.
"""

from dataclasses import dataclass

FLAG = "--prompt-length-schedule"


@dataclass(frozen=True)
class PromptLengthSchedule:
    """Stages of ``(prompt length, steps)``; the last stage's steps are ``None`` (to the end)."""

    stages: tuple[tuple[int, int | None], ...]

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
                raise ValueError(f"{FLAG} {text!r}: stage {piece!r} is not LENGTH:STEPS") from None
            if length_value < 1 or (steps_value is not None and steps_value < 1):
                raise ValueError(f"{FLAG} {text!r}: stage {piece!r} needs a length and steps >= 1")
            if steps_value is None and not last:
                raise ValueError(f"{FLAG} {text!r}: only the last stage may leave out its steps ({piece!r})")
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
        return max(length for length, _ in self.stages)
