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


def read_hf_config(folder: Path) -> dict:
    """The HF config stored with a checkpoint (in the folder or its save directory)."""
    for candidate in (folder / HF_CONFIG_NAME, folder.parent / HF_CONFIG_NAME):
        if candidate.is_file():
            config = json.loads(candidate.read_text())
            config["_source"] = str(candidate)
            return config
    raise ValueError(f"--load {folder}: no {HF_CONFIG_NAME} in the checkpoint; pass --model")


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


def load_model_checkpoint(model, path: str | Path, strict: bool = True) -> Path:
    """Load a checkpoint (any saved layout) into this rank's ``model``; returns its folder."""
    folder = resolve_checkpoint_dir(path)
    state = dist_checkpointing.load(model.sharded_state_dict(), str(folder))
    model.load_state_dict(state, strict=strict)
    return folder
