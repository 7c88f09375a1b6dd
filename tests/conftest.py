"""Shared fixtures: a single-process Megatron setup for CPU tests; GPU tests are marked."""

import pytest
import torch


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
    from megatron_longstraw.distributed import ParallelSizes, destroy_distributed, init_distributed

    init_distributed(ParallelSizes(), seed=1234)
    yield
    destroy_distributed()
