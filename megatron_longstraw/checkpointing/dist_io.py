"""Stream tensors into and out of a Megatron ``torch_dist`` checkpoint, chunk by chunk.

Megatron's ``torch_dist`` format is a PyTorch Distributed Checkpoint (DCP) folder whose keys
are the ``ShardedTensor`` keys (global shapes, chunks at their global offsets; prepended expert
axes included) and whose ``ShardedObject`` entries are ``torch.save`` bytes under their unique
keys, plus Megatron's ``metadata.json`` (and an empty ``common.pt``, which older Megatron reads). Megatron's own async writer stages
every tensor before writing; here a ``SavePlanner`` hands DCP's ``FileSystemWriter`` one chunk
at a time (``resolve_data`` is called item by item by its serial loader, one thread, one file),
so only the tensors being converted are in memory. Reads use a ``LoadPlanner`` that copies the
requested chunks (any saved sharding: DCP reshards) straight into caller-given tensors.
"""

import io
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_longstraw.checkpointing.layout import Chunk

COMMON_NAME = "common.pt"
METADATA_NAME = ".metadata"  # DCP's index of the data files


class _StreamingSavePlanner(SavePlanner):
    """Writes the given items; ``resolve(item)`` produces each tensor when DCP writes it."""

    def __init__(self, items: list[WriteItem], resolve: Callable[[WriteItem], object]):
        self.items, self.resolve = items, resolve

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        """Nothing to set up: the items are known."""

    def create_local_plan(self) -> SavePlan:
        """All items, in the given order (the writer keeps it with one thread)."""
        return SavePlan(self.items)

    def create_global_plan(self, all_plans):
        """DCP's default metadata for the items."""
        return create_default_global_save_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """The plan as is."""
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        """The item's tensor (or bytes), produced now."""
        return self.resolve(write_item)


def tensor_item(chunk: Chunk, dtype: torch.dtype) -> WriteItem:
    """The DCP write item of one chunk."""
    return WriteItem(
        index=MetadataIndex(chunk.key, torch.Size(chunk.offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(chunk.global_shape),
        ),
    )


def object_item(unique_key: str) -> WriteItem:
    """The DCP write item of one ``ShardedObject``."""
    return WriteItem(index=MetadataIndex(unique_key), type=WriteItemType.BYTE_IO)


def object_bytes(value) -> io.BytesIO:
    """A ``ShardedObject``'s data as Megatron stores it (``torch.save`` of a one-item list)."""
    buffer = io.BytesIO()
    torch.save([value], buffer)
    buffer.seek(0)
    return buffer


def write_dist_checkpoint(folder: Path, items: list[WriteItem],
                          resolve: Callable[[WriteItem], object]) -> None:
    """Write a Megatron ``torch_dist`` checkpoint holding ``items`` into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    writer = dcp.FileSystemWriter(folder, single_file_per_rank=True, thread_count=1,
                                  sync_files=True, overwrite=True)
    dcp.save({}, storage_writer=writer, planner=_StreamingSavePlanner(items, resolve), no_dist=True)
    torch.save({}, folder / COMMON_NAME)
    save_config(CheckpointingConfig(sharded_backend="torch_dist"), str(folder))


def read_metadata(folder: Path, flag: str = "--load") -> Metadata:
    """The DCP metadata of a checkpoint folder, after checking that every data file it indexes
    is there and long enough: ``ValueError`` naming ``flag``, the folder and the file otherwise."""
    path = folder / METADATA_NAME
    if not path.is_file():
        raise ValueError(f"{flag} {folder}: not a torch_dist checkpoint (no {METADATA_NAME})")
    try:
        metadata = dcp.FileSystemReader(folder).read_metadata()
    except Exception as err:  # pickle's errors on a truncated or overwritten file vary
        raise ValueError(f"{flag} {folder}: checkpoint is corrupt or incomplete: {METADATA_NAME} does not "
                         f"read ({type(err).__name__}; truncated?)") from None
    needed: dict[str, int] = {}  # data file -> bytes the index reaches into it
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = folder / name
        if not file.is_file():
            raise ValueError(f"{flag} {folder}: checkpoint is corrupt or incomplete: {name} is missing")
        have = file.stat().st_size
        if have < size:
            raise ValueError(f"{flag} {folder}: checkpoint is corrupt or incomplete: {name} is truncated "
                             f"({have} bytes; its index needs {size})")
    return metadata


def one_line(err: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def shape_mismatch(sharded_state_dict: dict, metadata: Metadata) -> str | None:
    """The first tensor of ``sharded_state_dict`` (a model's ``sharded_state_dict()``; its
    factories are applied in place) that the checkpoint lacks or holds in another global shape,
    as a phrase naming it and both shapes; ``None`` when every tensor is there in its shape."""
    apply_factories(sharded_state_dict)
    stored = metadata.state_dict_metadata
    for tensor in nested_values(sharded_state_dict):
        if not isinstance(tensor, ShardedTensor):
            continue
        if tensor.key not in stored:
            return f"it has no tensor {tensor.key!r} (shape {tuple(tensor.global_shape)} in this model)"
        shape = tuple(getattr(stored[tensor.key], "size", ()))
        if shape != tuple(tensor.global_shape):
            return (f"tensor {tensor.key!r} has shape {shape} in the checkpoint and "
                    f"{tuple(tensor.global_shape)} in this model")
    return None


class _ChunkLoadPlanner(LoadPlanner):
    """Reads the given chunks (key, offsets) into the given tensors."""

    def __init__(self, targets: list[tuple[str, tuple[int, ...], torch.Tensor]]):
        self.targets = {(key, tuple(offsets)): tensor for key, offsets, tensor in targets}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        """Keep the checkpoint metadata."""
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        """DCP's resharding reads for every target chunk."""
        requests = []
        for (key, offsets), tensor in self.targets.items():
            stored = self.metadata.state_dict_metadata[key]
            wanted = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.shape)
            requests += create_read_items_for_chunk_list(key, stored, [wanted])
        return LoadPlan(requests)

    def create_global_plan(self, global_plan):
        """Single process: unchanged."""
        return global_plan

    def finish_plan(self, central_plan):
        """Unchanged."""
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        """No objects are requested."""

    def resolve_tensor(self, read_item) -> torch.Tensor:
        """The part of the target tensor that this read fills."""
        target = self.targets[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            target = target.narrow(dim, start, length)
        return target

    def commit_tensor(self, read_item, tensor) -> None:
        """The data was copied into the target in place."""


def read_chunks(folder: Path, targets: list[tuple[str, tuple[int, ...], torch.Tensor]]) -> None:
    """Fill each ``(key, global offsets, tensor)`` target from the checkpoint in ``folder``."""
    dcp.load({}, storage_reader=dcp.FileSystemReader(folder), planner=_ChunkLoadPlanner(targets),
             no_dist=True)


def stored_dtype(metadata: Metadata, key: str) -> torch.dtype:
    """The dtype a tensor was saved with."""
    entry = metadata.state_dict_metadata[key]
    assert isinstance(entry, TensorStorageMetadata)
    return entry.properties.dtype
