"""Progress display for long phases (prompt capture, decoding), on rank 0 only."""

import contextlib
import sys

import torch
from tqdm import tqdm

# Phases shorter than this many units show no bar (the tiny demo stays quiet).
MIN_UNITS = 4096


@contextlib.contextmanager
def progress_bar(total: int, phase: str, always: bool = False):
    """A tqdm bar over ``total`` units (tokens) on rank 0 when the phase is long (or ``always``:
    ``--progress``), on a terminal; otherwise a bar that only counts. Yields an object with
    ``update(n)`` and ``n``."""
    show = torch.distributed.get_rank() == 0 and (always or (total >= MIN_UNITS and sys.stderr.isatty()))
    bar = tqdm(total=total, desc=phase, unit="tok", disable=not show, leave=False, dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()
