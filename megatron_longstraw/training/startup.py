"""Where a run starts from: the checkpoint it resumes (``resume_path``) and what its model config
is read from (``model_source``), both derived from the configuration and the files it names.

Each raises ``ValueError`` naming the flag where the files contradict the command line: a fresh
run never silently replaces an earlier one, and a ``--model`` must describe the
``--pretrained-checkpoint``'s architecture. ``training/arguments.py`` calls both once at start-up
(so a bad combination fails before torch.distributed starts); the trainer calls them again for
their values, which the files have not changed in between.
"""

import re
from pathlib import Path
from typing import Optional

from megatron_longstraw.checkpointing.model_checkpoint import (TRACKER_NAME, has_hf_config, read_hf_config,
                                                               resolve_checkpoint_dir, resolve_model_config)
from megatron_longstraw.config.model import DEFAULT_MODEL
from megatron_longstraw.config.trainer import TrainerConfig
from megatron_longstraw.models.family import ModelFamily
from megatron_longstraw.models.hf_config import architecture_differences
from megatron_longstraw.models.registry import family_for
from megatron_longstraw.training.run_logger import METRICS_NAME, has_rows


def resume_path(config: TrainerConfig) -> Optional[str]:
    """The checkpoint the run resumes: ``--load``, else ``--save`` when it holds one (not with
    ``--no-load`` or ``--no-save``); ``None`` for a fresh run. A fresh run is refused without
    ``--overwrite`` where ``--save`` holds checkpoints or ``--wandb-save-dir`` holds metrics rows;
    ``--skip-train`` needs a checkpoint to evaluate."""
    ckpt = config.checkpoint
    save = Path(ckpt.save)
    tracker = save / TRACKER_NAME
    if config.evaluation.skip_train:
        if ckpt.load is None and (ckpt.no_load or ckpt.no_save or not tracker.is_file()):
            raise ValueError(f"--skip-train: no checkpoint to evaluate (give --load, or a --save that holds one; "
                             f"--save is {ckpt.save})")
        return ckpt.save if ckpt.load is None else ckpt.load
    if ckpt.load is None and not ckpt.no_load and not ckpt.no_save and tracker.is_file():
        return ckpt.save
    if ckpt.load is not None or ckpt.overwrite:
        return ckpt.load
    saved = sorted(p.name for p in save.glob("iter_*") if re.fullmatch(r"iter_\d{7}", p.name) and p.is_dir())
    if not ckpt.no_save and tracker.is_file():
        raise ValueError(f"--save {save} already holds a checkpoint (iteration {tracker.read_text().strip()}) and "
                         "--no-load starts fresh: add --overwrite to start anyway (a checkpoint is replaced only "
                         "when this run saves its iteration), or drop --no-load to resume from it")
    if not ckpt.no_save and saved:
        raise ValueError(f"--save {save} holds checkpoints (the newest: {saved[-1]}) but no {TRACKER_NAME}, so a "
                         f"fresh run would replace them: resume one with --load {save / saved[-1]}, or start "
                         "fresh with --no-load --overwrite")
    metrics = Path(config.logging.wandb_save_dir) / METRICS_NAME
    if has_rows(metrics):
        why = ("--no-load" if ckpt.no_load else "--no-save: nothing is resumed" if ckpt.no_save
               else f"no checkpoint in --save {save}")
        raise ValueError(f"{metrics} holds an earlier run's metrics and this run starts fresh ({why}): add "
                         f"--overwrite to start anyway (that file is then kept as {METRICS_NAME}.N), or resume "
                         "that run with --load")
    return None


def model_source(config: TrainerConfig, extra_family: Optional[ModelFamily] = None) -> str:
    """What the model config is read from: the ``--pretrained-checkpoint`` when it stores one
    (``--model`` / ``--hf-config``, when given, must describe the same architecture), else
    ``--hf-config``, ``--model`` or the default preset. ``extra_family``: an out-of-tree family
    (``--model-family``) not yet registered."""
    model, pretrained = config.model, config.checkpoint.pretrained_checkpoint
    flag, given = model.spec_flag, model.spec
    if pretrained is None:
        return given or DEFAULT_MODEL
    folder = resolve_checkpoint_dir(pretrained, flag="--pretrained-checkpoint")
    if not has_hf_config(folder):
        if given is None:
            raise ValueError(f"--pretrained-checkpoint {folder}: the checkpoint does not store its model "
                             "(no hf_config.json); pass --model")
        return given
    stored = read_hf_config(folder, flag="--pretrained-checkpoint")
    if given is None:
        return pretrained

    def normalized(hf):
        model_type = hf.get("model_type")
        family = extra_family if extra_family and model_type in extra_family.model_types else None
        try:
            family = family or family_for(model_type)
        except ValueError as err:  # an unknown model_type: name the file
            raise ValueError(f"{hf.get('_source', 'config')}: {err}") from None
        return family.normalize_hf_config(hf)

    differences = architecture_differences(normalized(resolve_model_config(given, flag=flag)), normalized(stored))
    if differences:
        shown = ", ".join(f"{field} {_short(mine)} vs {_short(theirs)}" for field, mine, theirs in differences)
        raise ValueError(f"{flag} {given} is another model than --pretrained-checkpoint {folder} ({shown}); "
                         f"leave out {flag} to train the checkpoint's model")
    return pretrained


def model_source_flag(config: TrainerConfig, source: str) -> str:
    """The flag that names ``source`` (for errors about it)."""
    if source == config.checkpoint.pretrained_checkpoint:
        return "--pretrained-checkpoint"
    return config.model.spec_flag


def _short(value, limit: int = 60) -> str:
    """A config value on at most ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
