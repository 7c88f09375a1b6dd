"""What an HF model folder holds beside the weights the Megatron model trains: its tokenizer, its
generation config, and the weights outside the Megatron model that a server uses (the
multi-token-prediction layers, ``KEPT_WEIGHTS``).

``hf-to-mcore`` keeps them in the Megatron checkpoint (``hf_assets/``), the trainer's saves carry
them on (from the checkpoint it started from, the tokenizer from ``--tokenizer-model``), and
``mcore-to-hf`` writes them back (the kept weights into the safetensors shards), so the exported
folder is the published checkpoint with the trained weights: it loads in ``transformers`` with
its tokenizer and is what vLLM or SGLang serve, speculative decoding included.
"""

import os
import shutil
from pathlib import Path

ASSETS_DIR = "hf_assets"
"""The folder inside a checkpoint (an ``iter_XXXXXXX`` folder or a converted checkpoint) that
holds the files."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
                   "chat_template.json")
"""What ``transformers`` tokenizers save (fast and slow, SentencePiece, BPE, chat templates)."""

GENERATION_FILES = ("generation_config.json",)
"""The sampling defaults (EOS ids, temperature, top-p) servers read."""

KEPT_WEIGHTS = "kept_weights.safetensors"
"""The HF tensors outside the Megatron model that the export writes back unchanged (a family's
``WeightMap.kept``: multi-token prediction), under their HF names. It can be large (GLM-5's MTP
layer holds a full MoE layer), so it travels as a path: linked into each save, else copied."""

KEPT_FILES = (KEPT_WEIGHTS,)

ALL_FILES = TOKENIZER_FILES + GENERATION_FILES + KEPT_FILES


def find_assets(folder: str | Path | None, names=ALL_FILES) -> dict[str, Path]:
    """``name -> path`` of the files among ``names`` in ``folder`` (none for ``None`` or a file)."""
    if folder is None or not Path(folder).is_dir():
        return {}
    return {name: Path(folder) / name for name in names if (Path(folder) / name).is_file()}


def checkpoint_assets(folder: str | Path) -> dict[str, Path]:
    """The files a checkpoint folder keeps (its ``hf_assets/``, or its save directory's)."""
    for candidate in (Path(folder) / ASSETS_DIR, Path(folder).parent / ASSETS_DIR):
        found = find_assets(candidate)
        if found:
            return found
    return {}


def tokenizer_assets(tokenizer_model: str | Path | None) -> dict[str, Path]:
    """The tokenizer files of a ``--tokenizer-model`` folder (or of the folder of a
    ``tokenizer.json`` path); none for a SentencePiece file or nothing."""
    if tokenizer_model is None:
        return {}
    path = Path(tokenizer_model)
    return find_assets(path if path.is_dir() else path.parent, TOKENIZER_FILES) if path.exists() else {}


def override_assets(base: dict, newer: dict) -> dict:
    """``base`` with ``newer``'s files, group by group: a tokenizer is replaced as a whole (when
    ``newer`` has any tokenizer file, none of ``base``'s stays beside it: a ``tokenizer.json`` of
    one tokenizer and a ``vocab.json`` of another would load as neither), and so is the
    generation config."""
    out = {}
    for group in (TOKENIZER_FILES, GENERATION_FILES, KEPT_FILES):
        source = newer if any(name in newer for name in group) else base
        out.update({name: value for name, value in source.items() if name in group})
    return out


def read_assets(assets: dict[str, Path]) -> dict[str, bytes | Path]:
    """The small files' contents, so that writing them later needs nothing on disk; the kept
    weights stay a path (``KEPT_WEIGHTS``)."""
    return {name: Path(path) if name in KEPT_FILES else Path(path).read_bytes() for name, path in assets.items()}


def copy_assets(assets: dict[str, Path | bytes], destination: str | Path) -> list[str]:
    """Write ``assets`` (paths or contents) into ``destination`` (created if needed); the names.
    The kept weights are hard-linked where the file system allows (a checkpoint's files are never
    written again), else copied."""
    if not assets:
        return []
    Path(destination).mkdir(parents=True, exist_ok=True)
    for name, value in sorted(assets.items()):
        target = Path(destination) / name
        if isinstance(value, bytes):
            target.write_bytes(value)
        elif name in KEPT_FILES:
            try:
                os.link(value, target)
            except OSError:  # another file system, or links not allowed
                shutil.copyfile(value, target)
        else:
            shutil.copyfile(value, target)
    return sorted(assets)
