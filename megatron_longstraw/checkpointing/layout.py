"""The Megatron distributed-checkpoint layout of a model, without allocating it.

``model_layout(hf)`` builds the project's model (local spec, TP=PP=EP=1) with every parameter
on PyTorch's ``meta`` device and takes Megatron's own ``sharded_state_dict()`` (factories
applied): the checkpoint keys, global shapes and chunks are exactly what Megatron saves and
what ``dist_checkpointing.load`` expects, under any later TP/PP/EP layout. Each chunk's data is a
view of one parameter; its size, stride and storage offset (meta tensors keep them) say which
part of the full (unsharded, local-spec-named) weight the chunk holds.
"""

import contextlib
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

from megatron_longstraw.models.builder import build_model
from megatron_longstraw.models.options import ModelOptions


@dataclass(frozen=True)
class Chunk:
    """One saved piece of a checkpoint tensor and where it comes from in a full weight."""

    key: str                          # checkpoint (DCP) key
    offsets: tuple[int, ...]          # global offset, prepended axes included
    sizes: tuple[int, ...]            # chunk shape, prepended axes as 1
    global_shape: tuple[int, ...]
    param: str                        # full weight name (local spec, global expert numbers)
    view: tuple[tuple, tuple, int]    # as_strided (size, stride, storage offset) into the weight

    def split(self, max_elements: int) -> list["Chunk"]:
        """This chunk cut along its first non-unit dimension into pieces of at most
        ``max_elements`` elements (where rows allow): smaller write units, same data."""
        prepend = len(self.sizes) - len(self.view[0])
        dims = [d for d in range(prepend, len(self.sizes)) if self.sizes[d] > 1]
        numel = 1
        for size in self.sizes:
            numel *= size
        if numel <= max_elements or not dims:
            return [self]
        dim = dims[0]
        row = numel // self.sizes[dim]
        step = max(1, max_elements // row)
        size, stride, storage_offset = self.view
        pieces = []
        for start in range(0, self.sizes[dim], step):
            length = min(step, self.sizes[dim] - start)
            local = list(size)
            local[dim - prepend] = length
            pieces.append(Chunk(
                key=self.key,
                offsets=tuple(o + start if d == dim else o for d, o in enumerate(self.offsets)),
                sizes=tuple(length if d == dim else s for d, s in enumerate(self.sizes)),
                global_shape=self.global_shape,
                param=self.param,
                view=(tuple(local), stride, storage_offset + start * stride[dim - prepend]),
            ))
        return pieces

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """This chunk's part of the full weight, in the chunk's shape (a view: writes go through)."""
        return full.as_strided(*self.view).view(self.sizes)


@dataclass
class Layout:
    """Chunks and objects of a model's checkpoint, and the full weights they come from."""

    chunks: list[Chunk]
    objects: dict[str, object]                # ShardedObject unique key -> data
    params: dict[str, torch.Size]             # full weight name -> shape
    param_dtypes: dict[str, torch.dtype]

    def chunks_by_param(self) -> dict[str, list[Chunk]]:
        """Chunks grouped by full weight, in model order."""
        out: dict[str, list[Chunk]] = {name: [] for name in self.params}
        for chunk in self.chunks:
            out[chunk.param].append(chunk)
        return out


@contextlib.contextmanager
def meta_device():
    """Create every tensor on the meta device, also where Megatron passes
    ``device=torch.cuda.current_device()`` explicitly (the one place this is patched)."""
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("meta")
    try:
        with torch.device("meta"):
            yield
    finally:
        torch.cuda.current_device = original


def model_layout(hf: dict) -> Layout:
    """The TP=1 checkpoint layout of the model for ``hf`` (needs Megatron state at size 1)."""
    sizes = (parallel_state.get_tensor_model_parallel_world_size(),
             parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_expert_model_parallel_world_size())
    if sizes != (1, 1, 1):
        raise ValueError(f"checkpoint conversion runs with TP=PP=EP=1, got {sizes}")
    with meta_device():
        model = build_model(hf, ModelOptions(perform_initialization=False), to_device=False)
    named = dict(model.named_parameters())
    named.update(dict(model.named_buffers()))
    on_cpu = [n for n, t in named.items() if not t.is_meta]
    if on_cpu:
        raise AssertionError(f"model_layout: {on_cpu[:3]} were not created on the meta device")
    by_id = {id(t): n for n, t in named.items()}
    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    chunks, objects = [], {}
    for value in nested_values(sharded):
        if isinstance(value, ShardedObject):
            objects[value.unique_key] = value.data
            continue
        if not isinstance(value, ShardedTensor):
            raise AssertionError(f"model_layout: unexpected {type(value).__name__} in the state")
        data = value.data
        base = data._base if data._base is not None else data
        if id(base) not in by_id:
            raise AssertionError(f"checkpoint tensor {value.key!r} is not a view of a weight")
        chunks.append(Chunk(
            key=value.key,
            offsets=tuple(value.global_offset),
            sizes=(1,) * value.prepend_axis_num + tuple(value.local_shape),
            global_shape=tuple(value.global_shape),
            param=by_id[id(base)],
            view=(tuple(data.shape), tuple(data.stride()), data.storage_offset()),
        ))
    params = {n: named[n].shape for n in dict.fromkeys(c.param for c in chunks)}
    return Layout(chunks, objects, params, {n: named[n].dtype for n in params})
