"""Convert checkpoints between Hugging Face safetensors folders and Megatron distributed
checkpoints (``torch_dist``), streaming a few tensors at a time, for every model family.

hf-to-mcore reads an HF folder (``config.json`` + ``model.safetensors`` or sharded safetensors
with ``model.safetensors.index.json``) and writes a Megatron checkpoint that
``megatron_longstraw.checkpointing.model_checkpoint.load_model_checkpoint`` loads under any
TP/PP/EP layout; the HF config is stored with it as ``hf_config.json``.

mcore-to-hf reads a Megatron checkpoint folder or save directory
(``latest_checkpointed_iteration.txt``), saved under any layout, and writes safetensors shards,
the index and ``config.json`` that ``transformers`` loads with ``from_pretrained``.

Both directions keep the tokenizer files and ``generation_config.json``: hf-to-mcore stores the
HF folder's in the checkpoint (``hf_assets/``), the trainer's saves carry them on, and
mcore-to-hf writes them beside the weights (``--tokenizer-model`` gives another tokenizer), so
the output is a folder vLLM or SGLang serve.

Output goes to a temporary folder renamed into place on success; a failure leaves nothing.

Examples:
    python tools/convert_checkpoint.py hf-to-mcore --load /models/Qwen3.5-27B --save /ckpt/qwen
    python tools/convert_checkpoint.py mcore-to-hf --load /ckpt/run1 --save /models/run1-hf \\
        --max-shard-size 5GB
"""

import argparse
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_longstraw.config import cli  # noqa: E402
from megatron_longstraw.config.model import ModelConfig  # noqa: E402

DIRECTIONS = ("hf-to-mcore", "mcore-to-hf")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``"5GB"`` -> bytes; ``ValueError`` naming the flag otherwise."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"--max-shard-size {text!r}: expected a size such as 5GB or 500MB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line parser (Megatron-style groups)."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("direction", choices=DIRECTIONS, help="conversion direction")
    group = parser.add_argument_group("checkpoint")
    group.add_argument("--load", required=True,
                       help="input: HF folder (hf-to-mcore) or Megatron checkpoint (mcore-to-hf)")
    group.add_argument("--save", required=True, help="output folder (must not exist)")
    group.add_argument("--overwrite", action="store_true", help="replace an existing --save")
    cli.add_flags(parser, ModelConfig, only=("model_family",))
    group = parser.add_argument_group("mcore-to-hf")
    group.add_argument("--model", default=None,
                       help="HF config (preset, folder or config.json) when the checkpoint has "
                            "no hf_config.json")
    group.add_argument("--tokenizer-model", default=None, metavar="FOLDER",
                       help="an HF tokenizer folder whose files the output gets (default: the "
                            "tokenizer the checkpoint keeps, if any)")
    group.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard")
    group = parser.add_argument_group("logging")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def validate_args(args) -> argparse.Namespace:
    """Check flags that argparse cannot; ``ValueError`` naming the flag."""
    args.max_shard_bytes = parse_size(args.max_shard_size)
    if args.max_shard_bytes <= 0:
        raise ValueError(f"--max-shard-size {args.max_shard_size!r} must be positive")
    if args.model is not None and args.direction != "mcore-to-hf":
        raise ValueError("--model is only for mcore-to-hf (hf-to-mcore reads config.json)")
    if args.tokenizer_model is not None:
        from megatron_longstraw.checkpointing.hf_assets import tokenizer_assets

        if args.direction != "mcore-to-hf":
            raise ValueError("--tokenizer-model is only for mcore-to-hf (hf-to-mcore keeps the --load folder's)")
        if not tokenizer_assets(args.tokenizer_model):
            raise ValueError(f"--tokenizer-model {args.tokenizer_model}: no tokenizer files there "
                             "(tokenizer.json, tokenizer_config.json, ...)")
    if Path(args.load).absolute() == Path(args.save).absolute():
        raise ValueError("--save must differ from --load")
    return args


def _process_group_exists() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def main(argv=None) -> int:
    """Run the conversion; a user error prints one line and exits with status 2."""
    args = get_args_parser().parse_args(argv)
    if not _process_group_exists():  # a single-process tool: ignore an inherited launcher env
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(name, None)
    try:
        validate_args(args)
        from megatron_longstraw.checkpointing.convert import (
            hf_to_mcore_checkpoint,
            mcore_to_hf_checkpoint,
        )
        from megatron_longstraw.models.registry import use_family

        if args.model_family:
            try:
                use_family(args.model_family)
            except ValueError as err:
                raise ValueError(f"--model-family: {err}") from None

        if args.direction == "hf-to-mcore":
            summary = hf_to_mcore_checkpoint(args.load, args.save, overwrite=args.overwrite,
                                             progress=not args.no_progress)
        else:
            summary = mcore_to_hf_checkpoint(args.load, args.save, model=args.model,
                                             tokenizer_model=args.tokenizer_model,
                                             max_shard_bytes=args.max_shard_bytes,
                                             overwrite=args.overwrite,
                                             progress=not args.no_progress)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{args.direction}: wrote {args.save} ({summary})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
