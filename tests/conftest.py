"""Shared fixtures: a single-process Megatron setup for CPU tests; GPU tests are marked.

On a host of several GPUs the GPU tier runs under pytest-xdist (``-n N``) with
``LONGSTRAW_TEST_GPUS=N``: each worker then sees one GPU of its own.
"""

import os
from pathlib import Path

import pytest

# The tests' subprocesses (tools/ and examples/ scripts, torch.distributed.run workers) import this
# checkout's package too, whichever checkout the environment's editable install points to.
_ROOT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join([_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])

if os.environ.get("LONGSTRAW_TEST_GPUS") and os.environ.get("PYTEST_XDIST_WORKER"):
    # before anything initializes CUDA; gw0, gw1, ... -> GPU 0, 1, ...
    worker = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw"))
    os.environ["CUDA_VISIBLE_DEVICES"] = str(worker % int(os.environ["LONGSTRAW_TEST_GPUS"]))

import torch  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run on the GPU host)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def single_process():
    """Megatron parallel state with every size 1 (one process, gloo on CPU)."""
    from megatron_longstraw.config.parallel import ParallelSizes
    from megatron_longstraw.distributed import destroy_distributed, init_distributed

    init_distributed(ParallelSizes(), seed=1234)
    yield
    destroy_distributed()
