"""Save and load the project's model as a Megatron distributed checkpoint (any TP/PP/EP layout).

A checkpoint folder is Megatron's ``torch_dist`` format plus ``hf_config.json`` (the model's HF
config, so converters and the trainer know which model it holds). A Megatron save directory
(``latest_checkpointed_iteration.txt`` + ``iter_XXXXXXX/``) is accepted wherever a checkpoint
folder is.
"""

import json
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException

from megatron_longstraw.checkpointing import dist_io
from megatron_longstraw.config.model import DEFAULT_MODEL, ModelConfig
from megatron_longstraw.models.hf_config import read_config_json
from megatron_longstraw.models.presets import resolve_hf_config, with_num_layers
from megatron_longstraw.models.registry import family_for
from megatron_longstraw.models.rope import with_yarn

HF_CONFIG_NAME = "hf_config.json"
TRACKER_NAME = "latest_checkpointed_iteration.txt"


def resolve_checkpoint_dir(path: str | Path, flag: str = "--load") -> Path:
    """The checkpoint folder for a folder or a Megatron save directory (latest iteration)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{flag} {path}: no such folder")
    tracker = path / TRACKER_NAME
    if tracker.is_file():
        text = tracker.read_text().strip()
        folder = None
        if text == "release" or text.isdigit():
            folder = path / ("release" if text == "release" else f"iter_{int(text):07d}")
        if folder is None or not folder.is_dir():
            raise ValueError(f"{tracker}: names iteration {text!r}, whose folder does not exist")
        return folder
    return path


def read_hf_config(folder: Path, flag: str = "--load") -> dict:
    """The HF config stored with a checkpoint (in the folder or its save directory); errors
    name the file (and the line of invalid JSON)."""
    for candidate in (folder / HF_CONFIG_NAME, folder.parent / HF_CONFIG_NAME):
        if candidate.is_file():
            return read_config_json(candidate)
    raise ValueError(f"{flag} {folder}: no {HF_CONFIG_NAME} in the checkpoint; pass --model")


def has_hf_config(folder: Path) -> bool:
    """Whether a checkpoint folder (or its save directory) stores its HF config."""
    return any((f / HF_CONFIG_NAME).is_file() for f in (folder, folder.parent))


def resolve_model_config(spec: str, flag: str = "--model") -> dict:
    """The HF config that ``spec`` names: a preset, an HF folder or ``config.json``, or a
    checkpoint folder or save directory (``tools/convert_checkpoint.py`` output, a trainer save):
    its ``hf_config.json``."""
    path = Path(spec)
    if path.is_dir() and not (path / "config.json").is_file():
        folder = resolve_checkpoint_dir(path, flag=flag)
        if not has_hf_config(folder):
            raise ValueError(f"{flag} {spec}: neither an HF folder (no config.json) nor a checkpoint "
                             f"that stores its model (no {HF_CONFIG_NAME})")
        return read_hf_config(folder, flag=flag)
    return resolve_hf_config(spec)


def model_hf_config(model: ModelConfig, source: str | None = None, flag: str | None = None) -> dict:
    """The HF config of a command's ``model`` group: ``source`` (the trainer's model source),
    else ``--hf-config`` / ``--model``, else the default preset (``resolve_model_config``), with
    ``--num-layers``, ``--yarn-factor`` and ``--max-position-embeddings`` applied, as its family reads it
    (``normalize_hf_config``: e.g. a multimodal config's text model)."""
    flag = flag or model.spec_flag
    hf = resolve_model_config(source or model.spec or DEFAULT_MODEL, flag=flag)
    try:
        family = family_for(hf.get("model_type"))
    except ValueError as err:
        raise ValueError(f"{flag} {source or model.spec}: {err}") from None
    hf = family.normalize_hf_config(hf)
    if model.num_layers is not None:
        hf = with_num_layers(hf, model.num_layers)
    if model.yarn_factor is not None:
        hf = with_yarn(hf, model.yarn_factor)
    if model.max_position_embeddings:
        hf["max_position_embeddings"] = model.max_position_embeddings
    return hf


def write_hf_config(folder: Path, hf: dict) -> None:
    """Store the HF config with a checkpoint."""
    clean = {k: v for k, v in hf.items() if not k.startswith("_")}
    (Path(folder) / HF_CONFIG_NAME).write_text(json.dumps(clean, indent=2) + "\n")


def save_model_checkpoint(model, folder: str | Path) -> None:
    """Save this rank's part of ``model`` (every rank calls it) with its HF config."""
    folder = Path(folder)
    if torch.distributed.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(folder))
    if torch.distributed.get_rank() == 0:
        write_hf_config(folder, model.hf_config)
    torch.distributed.barrier()


def load_model_checkpoint(model, path: str | Path, strict: bool = True, flag: str = "--load") -> Path:
    """Load the model of a checkpoint (any saved layout; a converted model or a trainer's save,
    whose optimizer state is left) into this rank's ``model``; returns its folder.
    ``ValueError`` naming ``flag`` for a missing or truncated file, a checkpoint of another model
    (the first tensor it lacks or holds in another shape) or data that does not load."""
    folder = resolve_checkpoint_dir(path, flag=flag)
    metadata = dist_io.read_metadata(folder, flag=flag)
    mismatch = dist_io.shape_mismatch(model.sharded_state_dict(), metadata)
    if mismatch:
        raise ValueError(f"{flag} {folder}: a checkpoint of another model: {mismatch}")
    wanted = model.sharded_state_dict()
    try:
        state = dist_checkpointing.load(wanted, str(folder))
    except (Exception, CheckpointException) as err:  # many kinds for damaged files; torch's is a BaseException
        raise ValueError(f"{flag} {folder}: checkpoint is corrupt or incomplete ({dist_io.one_line(err)})") from err
    # a trainer's save also holds its optimizer and counters, which come back with the common
    # state: the model takes its own entries only
    model.load_state_dict({key: value for key, value in state.items() if key in wanted}, strict=strict)
    return folder
