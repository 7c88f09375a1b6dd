"""Training checkpoints: Megatron distributed checkpoints of everything a resume needs.

One checkpoint holds the model, the optimizer (Megatron's sharded optimizer state, so a resume
may use another TP/EP layout), the scheduler, every rank's RNG states, the iteration, the data
position and the reference model when ``--kl-coef`` > 0, plus ``hf_config.json`` and the
tokenizer and generation config (``hf_assets/``, what ``mcore-to-hf`` exports beside the weights). The layout is
Megatron's: ``<save>/iter_XXXXXXX/`` and ``<save>/latest_checkpointed_iteration.txt``.

Saves are atomic: ranks write into ``iter_XXXXXXX.tmp``; only when every rank has finished does
rank 0 rename it into place and then replace the tracker file (write + ``os.replace``), so a crash
mid-save leaves the previous checkpoint as the latest and loadable.
"""

import os
import random
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from torch.distributed.checkpoint.api import CheckpointException

from megatron_longstraw.checkpointing import dist_io
from megatron_longstraw.checkpointing.hf_assets import (
    ASSETS_DIR,
    checkpoint_assets,
    copy_assets,
    override_assets,
    read_assets,
    tokenizer_assets,
)
from megatron_longstraw.checkpointing.model_checkpoint import TRACKER_NAME, resolve_checkpoint_dir, write_hf_config
from megatron_longstraw.config.trainer import TrainerConfig


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_rng(state) -> ShardedObject:
    """Every model-parallel rank's RNG states (data-parallel replicas are identical copies)."""
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    return ShardedObject("rng_state", state, (world,), (rank,), replica_id=0)


def _sharded_state(model, optimizer, reference, rng, is_loading: bool = False) -> dict:
    model_sd = model.sharded_state_dict()
    # is_loading: Megatron first creates the (still empty) Adam moments, so the template has them
    state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading)}
    if rng is not None:
        state["rng_state"] = _sharded_rng(rng)
    if reference is not None:
        state["reference_model"] = reference.sharded_state_dict(prefix="reference_model.")
    return state


def run_assets(config: TrainerConfig, load: str | None) -> dict[str, bytes]:
    """The tokenizer and generation-config files a run's saves carry (``hf_assets``), read now:
    those of the checkpoint it resumes (``load``), else of the one it starts from, the tokenizer
    of its ``--tokenizer-model`` (what it tokenized with) replacing theirs as a whole."""
    kept = {}
    for flag, path in (("--pretrained-checkpoint", config.checkpoint.pretrained_checkpoint), ("--load", load)):
        if path:  # both already checked to be checkpoints; the resumed one's files win
            kept = override_assets(kept, checkpoint_assets(resolve_checkpoint_dir(path, flag=flag)))
    data = config.data
    tokenizer = data.tokenizer_model if data.tokenizer_type == "HuggingFaceTokenizer" else None
    return read_assets(override_assets(kept, tokenizer_assets(tokenizer)))


def save_checkpoint(save_dir: str, iteration: int, model, optimizer, scheduler, trainer_state: dict,
                    hf_config: dict, reference=None, assets: dict | None = None) -> Path:
    """Save atomically as ``<save_dir>/iter_XXXXXXX`` with ``assets`` (``run_assets``) in its
    ``hf_assets/``; every rank calls it. Rank 0 prints a line with the folder and the seconds the
    save took."""
    start = time.perf_counter()
    save_dir = Path(save_dir)
    final = save_dir / f"iter_{iteration:07d}"
    temporary = save_dir / f"iter_{iteration:07d}.tmp"
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        save_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir()
    torch.distributed.barrier()
    state = _sharded_state(model, optimizer, reference, _rng_state())
    state["scheduler"] = scheduler.state_dict()
    state["trainer"] = trainer_state
    state["iteration"] = iteration
    state["world_size"] = torch.distributed.get_world_size()
    state["has_reference"] = reference is not None
    dist_checkpointing.save(state, str(temporary))
    torch.distributed.barrier()
    if rank0:
        write_hf_config(temporary, hf_config)
        copy_assets(assets or {}, temporary / ASSETS_DIR)
        if final.exists():
            old = save_dir / f"iter_{iteration:07d}.old"
            final.rename(old)
            temporary.rename(final)
            shutil.rmtree(old)
        else:
            temporary.rename(final)
        tracker_tmp = save_dir / (TRACKER_NAME + ".tmp")
        tracker_tmp.write_text(f"{iteration}\n")
        os.replace(tracker_tmp, save_dir / TRACKER_NAME)
    torch.distributed.barrier()
    if rank0:
        print(f"saved checkpoint iteration {iteration} to {final} ({time.perf_counter() - start:.1f} s)", flush=True)
    return final


def load_checkpoint(path: str, model, optimizer, scheduler, reference=None) -> dict:
    """Restore everything saved; returns ``{"iteration", "trainer"}``. ``path`` is a save
    directory (its latest iteration) or an ``iter_XXXXXXX`` folder."""
    folder = resolve_checkpoint_dir(path, flag="--load")
    if not (folder / "metadata.json").is_file():
        raise ValueError(f"--load {folder}: not a Megatron distributed checkpoint (no metadata.json)")
    metadata = dist_io.read_metadata(folder)  # names a missing or truncated file
    try:
        common = dist_checkpointing.load_common_state_dict(str(folder))
    except (Exception, CheckpointException) as err:
        raise ValueError(f"--load {folder}: checkpoint is corrupt or incomplete (its common state does not "
                         f"load: {type(err).__name__})") from err
    for key in ("scheduler", "trainer", "iteration"):
        if key not in common:
            raise ValueError(f"--load {folder}: not a training checkpoint (no {key!r}); for initial weights "
                             "use --pretrained-checkpoint")
    if reference is not None and not common.get("has_reference"):
        raise ValueError(f"--load {folder}: saved without a reference model (--kl-coef 0); resume with "
                         "--kl-coef 0 or start a new run")
    same_world = common.get("world_size") == torch.distributed.get_world_size()
    if not same_world and torch.distributed.get_rank() == 0:
        warnings.warn(f"--load {folder}: saved with world size {common.get('world_size')}, resuming with "
                      f"{torch.distributed.get_world_size()}: RNG states are not restored")
    mismatch = dist_io.shape_mismatch(model.sharded_state_dict(), metadata)
    if mismatch:
        raise ValueError(f"--load {folder}: a checkpoint of another model: {mismatch}")
    template = _sharded_state(model, optimizer, reference, _rng_state() if same_world else None, is_loading=True)
    try:
        state = dist_checkpointing.load(template, str(folder))
    except (Exception, CheckpointException) as err:  # many kinds for damaged files; torch's is a BaseException
        raise ValueError(f"--load {folder}: checkpoint is corrupt or incomplete ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''})") from err
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if reference is not None:
        reference.load_state_dict({k.removeprefix("reference_model."): v
                                   for k, v in state["reference_model"].items()})
    if same_world:
        _set_rng_state(state["rng_state"])
    return {"iteration": state["iteration"], "trainer": state["trainer"]}



def set_aside_tracker(save_dir: str) -> None:
    """A fresh run into a ``--save`` that holds checkpoints (``--no-load --overwrite``), once its
    first step is done (before it writes anything): the earlier run's tracker becomes
    ``{TRACKER_NAME}.earlier``, so that a relaunch before this run's first save resumes neither run
    unasked (it is refused, naming the checkpoints); the earlier checkpoints stay, each replaced
    only when this run saves its iteration."""
    tracker = Path(save_dir) / TRACKER_NAME
    if torch.distributed.get_rank() == 0 and tracker.is_file():
        os.replace(tracker, tracker.with_name(TRACKER_NAME + ".earlier"))
        print(f"{tracker}: the earlier run's tracker is kept as {TRACKER_NAME}.earlier", flush=True)


def checkpoint_iteration(path: str) -> int:
    """The iteration of the training checkpoint ``path`` (a save directory's latest, or an
    ``iter_XXXXXXX`` folder), read from its common state without building or loading a model."""
    folder = resolve_checkpoint_dir(path, flag="--load")
    dist_io.read_metadata(folder)  # names a missing or truncated file
    try:
        common = dist_checkpointing.load_common_state_dict(str(folder))
    except (Exception, CheckpointException) as err:
        raise ValueError(f"--load {folder}: checkpoint is corrupt or incomplete (its common state does not "
                         f"load: {type(err).__name__})") from err
    if "iteration" not in common or "trainer" not in common:
        raise ValueError(f"--load {folder}: not a training checkpoint (no 'iteration'); for initial weights "
                         "use --pretrained-checkpoint")
    return int(common["iteration"])
