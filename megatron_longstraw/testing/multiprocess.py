"""Run a test function in N gloo processes (CPU) and collect each rank's return value."""

import io
import os
import socket
import traceback

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if os.environ.get("LONGSTRAW_WORKER_STACKS_AFTER"):  # debugging a hang: every thread's stack to stderr
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["LONGSTRAW_WORKER_STACKS_AFTER"]), exit=True)
    try:
        # as bytes: tensors sent as shared-memory handles can outlive a rank that already exited
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report every failure to the parent, which raises it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        from megatron_longstraw.distributed import destroy_distributed

        destroy_distributed()


def with_sizes(sizes, fn, *args):
    """A rank's body for ``run_multiprocess``: Megatron's parallel state at ``sizes``
    (``ParallelSizes``, seed 1234), then ``fn(*args)``."""
    from megatron_longstraw.distributed import init_distributed

    init_distributed(sizes, seed=1234)
    return fn(*args)


def run_multiprocess(fn, world_size: int, *args, timeout: float = 600.0) -> list:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks; returns results in rank order.

    ``fn`` must be importable (module level) and should call ``init_distributed`` itself.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    results = {}
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
    return [results[r] for r in range(world_size)]


def on_one_rank(fn, *args):
    """``fn(*args)`` in a one-process group (Megatron's parallel state set up, seed 1234), torn
    down afterwards: the single-rank reference that multi-rank runs are compared with."""
    from megatron_longstraw.distributed import ParallelSizes, destroy_distributed, init_distributed

    init_distributed(ParallelSizes(), seed=1234)
    try:
        return fn(*args)
    finally:
        destroy_distributed()
