"""Process-group and model-parallel initialization for one or many processes.

NCCL on GPU, gloo on CPU. Launch with ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``
set) or as a single plain process. Megatron's ``parallel_state`` gets the tensor, context,
expert and pipeline sizes; data parallelism takes what remains of the world size.
"""

import datetime
import os
import random
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from megatron_longstraw.config.parallel import ParallelSizes
from megatron_longstraw.patches import apply_patches


_OWN_ENV: dict[str, str] = {}  # rendezvous variables set by init_distributed, removed on destroy


def _ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel hands out for sockets bound to port 0 (Linux's setting, else IANA's)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free now and outside the kernel's ephemeral range, so no socket a
    run opens later (gloo's connections, store clients) can take one before its store listens on
    it (a port bound to 0 and released can). Each is tried with a bind, held until all are chosen."""
    low, high = _ephemeral_port_range()
    candidates = list(range(10000, low)) if low > 10000 + count else list(range(high + 1, 65536))
    random.SystemRandom().shuffle(candidates)  # unseeded: concurrent runs pick apart
    socks: list[socket.socket] = []
    try:
        for port in candidates:
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            socks.append(sock)
            if len(socks) == count:
                return [s.getsockname()[1] for s in socks]
        raise RuntimeError(f"fewer than {count} free ports outside the ephemeral range {low}-{high}")
    finally:
        for sock in socks:
            sock.close()


def device() -> torch.device:
    """The device this process computes on: its GPU, or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(sizes: ParallelSizes = ParallelSizes(), seed: int = 1234,
                     timeout_minutes: int = 30) -> None:
    """Create the default process group (if needed), Megatron's parallel groups, and seeds.

    Applies the CPU-compat patches first (a no-op on a GPU host).
    """
    apply_patches()
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a plain single process: rendezvous with itself
            own = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_PORT": str(free_ports(1)[0])}
            if "MASTER_ADDR" not in os.environ:
                own["MASTER_ADDR"] = "127.0.0.1"
            own = {k: v for k, v in own.items() if k not in os.environ}
            os.environ.update(own)
            _OWN_ENV.update(own)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend="nccl" if torch.cuda.is_available() else "gloo",
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    sizes.validate(dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tensor,
        pipeline_model_parallel_size=sizes.pipeline,
        virtual_pipeline_model_parallel_size=sizes.virtual_pipeline if sizes.virtual_pipeline > 1 else None,
        context_parallel_size=sizes.context,
        expert_model_parallel_size=sizes.expert,
        distributed_timeout_minutes=timeout_minutes,
        create_gloo_process_groups=not torch.cuda.is_available(),
    )
    seed_all(seed)


def seed_all(seed: int) -> None:
    """Seed torch and Megatron's RNG tracker (distinct TP/EP streams, as Megatron does)."""
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def destroy_distributed() -> None:
    """Tear down Megatron's groups and the default process group."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    for key, value in list(_OWN_ENV.items()):  # child processes must not inherit a stale rendezvous
        if os.environ.get(key) == value:
            del os.environ[key]
        del _OWN_ENV[key]
