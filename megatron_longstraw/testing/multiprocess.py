"""Run a test function in N gloo processes (CPU) and collect each rank's return value; run a command-line
script as a child of the same fork server (``run_script``), without a fresh interpreter's imports."""

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
            "megatron_longstraw.testing.parity", "megatron_longstraw.longstraw.capture",
            "megatron_longstraw.testing.preload"]


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


def _script_worker(path: str, argv: list, cwd, env, out_path: str, err_path: str) -> None:
    """In a fork-server child: ``python path *argv`` with stdout / stderr into the given files
    (and ``env`` as the environment, its ``PYTHONPATH`` on ``sys.path``), exiting with the
    script's status."""
    import runpy
    import sys

    status = 0
    with open(out_path, "w") as out, open(err_path, "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        if cwd is not None:
            os.chdir(cwd)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
            sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.argv = [path, *argv]
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # as ``python path`` puts it first
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as done:
            status = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
            if not isinstance(done.code, (int, type(None))):
                print(done.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            status = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
    os._exit(status)


def run_script(path, argv: list, *, cwd=None, env: dict | None = None, check: bool = False,
               timeout: float = 300.0):
    """``python path *argv`` as a child of the fork server (torch and Megatron already imported:
    seconds instead of a fresh interpreter's imports), in ``cwd`` with ``env`` (default: the
    fork server's environment): a ``subprocess.CompletedProcess`` with the exit status and text
    stdout / stderr; ``check``: raise ``CalledProcessError`` on a non-zero status, as
    ``subprocess.run`` does."""
    import subprocess
    import tempfile

    ctx = _context()
    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        proc = ctx.Process(target=_script_worker, args=(str(path), [str(a) for a in argv], cwd, env, out_path,
                                                        err_path))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.terminate()
            proc.join(30)
            raise subprocess.TimeoutExpired([str(path), *argv], timeout)
        with open(out_path) as out, open(err_path) as err:
            done = subprocess.CompletedProcess([str(path), *argv], proc.exitcode, out.read(), err.read())
    if check:
        done.check_returncode()
    return done
