"""Run a test function in N gloo processes (CPU) and collect each rank's return value."""

import io
import os
import traceback

import torch
import torch.multiprocessing as mp

from megatron_longstraw.distributed import free_ports


RUN_PORTS = 12  # store ports per spawn: one per process-group setup a rank's body may make


def use_port(index: int) -> None:
    """In a rank of ``run_multiprocess``: rendezvous the next process-group setup on the spawn's
    ``index``-th store port (a body that sets up and tears down several groups needs a fresh
    store each time: a re-used one still holds the previous rendezvous keys)."""
    ports = os.environ["LONGSTRAW_RUN_PORTS"].split(",")
    if index >= len(ports):
        raise ValueError(f"a spawn has {len(ports)} store ports; setup {index} needs more (RUN_PORTS)")
    os.environ["MASTER_PORT"] = ports[index]


def _worker(rank, world_size, ports, job, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LONGSTRAW_RUN_PORTS=",".join(map(str, ports)))
    if os.environ.get("LONGSTRAW_WORKER_STACKS_AFTER"):  # debugging a hang: every thread's stack to stderr
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["LONGSTRAW_WORKER_STACKS_AFTER"]), exit=True)
    try:
        fn, args = torch.load(io.BytesIO(job), weights_only=False)
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


# what every rank imports first: loaded once into the fork server, each rank forks from it
_PRELOAD = ["torch", "megatron.core.parallel_state", "megatron_longstraw.distributed",
            "megatron_longstraw.testing.multiprocess", "megatron_longstraw.models.builder",
            "megatron_longstraw.testing.parity", "megatron_longstraw.longstraw.capture"]


def _context():
    """A fork server that has imported ``_PRELOAD``: a rank starts without importing torch and
    Megatron again (fork server, not fork: the test process's threads and state stay out)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_multiprocess(fn, world_size: int, *args, timeout: float = 600.0) -> list:
    """Run ``fn(*args)`` on ``world_size`` ranks (processes of the fork server); returns results in rank order.

    ``fn`` must be importable (module level) and should call ``init_distributed`` itself.
    """
    ctx = _context()
    queue = ctx.Queue()
    ports = free_ports(RUN_PORTS)
    job = io.BytesIO()  # as bytes: a fork server hands a rank at most a few file descriptors,
    torch.save((fn, args), job)  # and tensors would each travel as one
    procs = [ctx.Process(target=_worker, args=(r, world_size, ports, job.getvalue(), queue))
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
    from megatron_longstraw.config.parallel import ParallelSizes
    from megatron_longstraw.distributed import destroy_distributed, init_distributed

    init_distributed(ParallelSizes(), seed=1234)
    try:
        return fn(*args)
    finally:
        destroy_distributed()
