"""The trainer's console: the libraries' known start-up notices filtered, one line in their place.

At import, at the first model build, load and save, Megatron, fla and torch warn about optional
packages that are absent (Transformer Engine, Apex, absl-py), about a missing GPU (no CUDA
runtime, no Triton), and about their own APIs, which the trainer does not choose: deprecated or
experimental ones (``GPTModel``, ``MimoModelConfig``, the CUDA-graph ``full`` scope, MCore's
async save) and torch's checkpoint reader as Megatron calls it. ``quiet_third_party`` filters
exactly those messages, by message, category and module (``warnings.filterwarnings``, and a
filter on each logger that emits one); ``optional_line`` says in one line what is absent. Every
other warning shows as before, and any ``-W`` option or ``PYTHONWARNINGS`` leaves all of them as
they are (``python -W default train_grpo.py`` shows the libraries' own lines). This module
imports no torch or Megatron.
"""

import importlib.util
import logging
import os
import sys
import warnings

# (message prefix, module) of each known warning
WARNINGS = (
    (r"Transformer Engine and Apex are not installed", r"megatron\."),
    (r"Apex is not installed", r"megatron\."),
    (r"absl\.logging is not installed", r"megatron\."),
    (r"MimoModelConfig is experimental", r"megatron\."),
    (r"full scope is deprecated", r"megatron\."),
    (r"Triton is not supported on current platform", r"fla\."),
    (r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a single "
     r"process", r"torch\.distributed\.checkpoint\."),
    (r"The argument order of load has been changed", r"torch\.distributed\.checkpoint\."),
)
# logger -> message prefixes of its known warnings
LOG_RECORDS = {
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),
    "megatron.core.models.gpt.gpt_model": ("GPTModel IS DEPRECATED",),
    "megatron.core.dist_checkpointing.strategies.torch": ("MCore's async save is deprecated",),
}
# (module, name, what runs in its place) of the optional packages
OPTIONAL = (("transformer_engine", "Transformer Engine", "local layers"),
            ("apex", "Apex", "torch optimizers"),
            ("absl", "absl-py", None))


class _DropPrefixes(logging.Filter):
    """Drops the records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes):
        super().__init__()
        self.prefixes = tuple(prefixes)

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def quiet_third_party() -> bool:
    """Filter the known notices (call before torch and Megatron load); False, filtering nothing,
    when the interpreter was given warning options (``-W``, ``PYTHONWARNINGS``)."""
    if sys.warnoptions:
        return False
    for message, module in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)
    for name, prefixes in LOG_RECORDS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropPrefixes) for f in logger.filters):
            logger.addFilter(_DropPrefixes(prefixes))
    return True


def optional_line() -> str | None:
    """``optional: ... not installed, no CUDA GPU; using ...``, naming what is absent (None when
    nothing is). The GPU is checked only once torch has loaded."""
    absent, instead = [], []
    for module, name, replacement in OPTIONAL:
        if importlib.util.find_spec(module) is None:
            absent.append(name)
            instead += [replacement] if replacement else []
    torch = sys.modules.get("torch")
    no_gpu = torch is not None and not torch.cuda.is_available()
    if not absent and not no_gpu:
        return None
    parts = [f"{', '.join(absent)} not installed"] if absent else []
    if no_gpu:
        parts.append("no CUDA GPU")
        instead.append("CPU fallbacks for the Triton kernels")
    line = f"optional: {', '.join(parts)}"
    return f"{line}; using {', '.join(instead)}" if instead else line


def print_optional_line() -> None:
    """Print ``optional_line`` on rank 0 (torchrun's ``RANK``: the process groups may not
    exist yet)."""
    line = optional_line()
    if line and os.environ.get("RANK", "0") == "0":
        print(line, flush=True)
