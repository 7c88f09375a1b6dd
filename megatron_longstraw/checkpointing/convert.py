"""Streaming conversion between HF safetensors folders and Megatron distributed checkpoints.

hf-to-mcore: the family's ``hf_group`` splits the HF tensors into groups that convert alone
(a fused q/k/v, a gate/up pair, one expert, ...); a first pass runs ``hf_to_mcore`` on meta
tensors (no data) to match every group against the model's checkpoint layout (names, shapes,
missing and unexpected tensors) before anything is written; the write pass converts one group
at a time as DCP asks for its chunks.

mcore-to-hf: every weight of the layout is read from the checkpoint chunk by chunk (whatever
TP/PP/EP it was saved with), converted with ``mcore_to_hf(checkpoint_layout=True)`` alone (or,
where the HF tensor stacks a layer's experts, with that layer's other experts:
``WeightMap.export_groups``) and streamed into safetensors shards of bounded size, with
``model.safetensors.index.json`` and ``config.json``.

Both keep the tokenizer files, ``generation_config.json`` and the HF tensors outside the Megatron
model that the family keeps (``WeightMap.kept``: multi-token prediction) (``hf_assets.py``):
hf-to-mcore stores them in the checkpoint (the tensors, unchanged, in ``kept_weights.safetensors``),
mcore-to-hf writes them beside the weights (the tensors into the shards).

Peak memory is about one group's HF tensors plus the Megatron tensors made from them (at most
twice the largest tensor of either layout) plus a fixed overhead (Python, torch, the meta
model); see ``docs/convert_memory.md``.
"""

import contextlib
import json
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException
from tqdm import tqdm

from megatron_longstraw.checkpointing import dist_io
from megatron_longstraw.checkpointing.atomic_output import atomic_output
from megatron_longstraw.checkpointing.hf_assets import (
    ASSETS_DIR,
    GENERATION_FILES,
    KEPT_WEIGHTS,
    TOKENIZER_FILES,
    checkpoint_assets,
    copy_assets,
    find_assets,
    override_assets,
    tokenizer_assets,
)
from megatron_longstraw.checkpointing.hf_folder import INDEX_NAME, SINGLE_NAME, HFFolder
from megatron_longstraw.checkpointing.layout import model_layout
from megatron_longstraw.checkpointing.model_checkpoint import (
    read_hf_config,
    resolve_checkpoint_dir,
    write_hf_config,
)
from megatron_longstraw.checkpointing.safetensors_io import SafetensorsWriter, read_header, read_tensor
from megatron_longstraw.models.registry import family_for


MAX_CHUNK_BYTES = 64 * 2**20  # larger checkpoint chunks are written as several pieces


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _single_process():
    """Megatron parallel state with every size 1 (initialized here unless already set up)."""
    from megatron.core import parallel_state

    from megatron_longstraw.config.parallel import ParallelSizes
    from megatron_longstraw.distributed import destroy_distributed, init_distributed

    if parallel_state.model_parallel_is_initialized():
        yield
        return
    init_distributed(ParallelSizes())
    try:
        yield
    finally:
        destroy_distributed()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _convert_meta(fn, tensors: dict, describe: str, **kwargs) -> dict:
    """Run a mapping on meta tensors; shape errors become a ValueError naming the tensors."""
    try:
        return fn(tensors, **kwargs)
    except ValueError:
        raise
    except (RuntimeError, IndexError) as err:
        shapes = {n: tuple(t.shape) for n, t in tensors.items()}
        raise ValueError(f"{describe} {shapes}: shapes do not match the config "
                         f"({str(err).splitlines()[0]})") from None


def plan_hf_groups(source: HFFolder, hf: dict, layout, family) -> tuple[list, list, list]:
    """``([(hf names, {weight: dtype})], dropped names, kept names)``: every layout weight from
    exactly one group, checked on meta tensors; ``ValueError`` naming the tensor otherwise. The
    kept tensors (``WeightMap.kept``) are checked against the config's count of their layers."""
    groups: dict[str, list[str]] = {}
    dropped, kept = [], []
    for name in source.names():
        group = family.weights.hf_group(name, hf)
        if group is None:
            (kept if family.weights.keeps(name, hf) else dropped).append(name)
        else:
            groups.setdefault(group, []).append(name)
    try:
        family.weights.check_kept(kept, hf)
    except ValueError as err:
        raise ValueError(f"{source.folder}: {err}") from None
    plan, produced = [], {}
    for names in groups.values():
        meta = {n: source.meta(n) for n in names}
        out = _convert_meta(lambda t: family.weights.hf_to_mcore(t, hf, partial=True), meta,
                            "HF tensors")
        for weight, tensor in out.items():
            if weight not in layout.params:
                raise ValueError(f"unexpected HF tensor {names[0]!r} (Megatron {weight!r} is not "
                                 f"in the model of {hf.get('_source', 'the config')})")
            if tuple(tensor.shape) != tuple(layout.params[weight]):
                raise ValueError(f"HF tensor {names[0]!r} has shape {tuple(meta[names[0]].shape)}"
                                 f", which gives {weight!r} of shape {tuple(tensor.shape)}; the "
                                 f"config expects {tuple(layout.params[weight])}")
            produced[weight] = names
        plan.append((names, {w: t.dtype for w, t in out.items()}))
    for weight, shape in layout.params.items():
        if weight not in produced:
            group = next(g for g in family.weights.export_groups(list(layout.params), hf) if weight in g)
            wanted = family.weights.mcore_to_hf({w: torch.empty(layout.params[w], device="meta") for w in group},
                                                hf, checkpoint_layout=True)
            raise ValueError(f"missing HF tensor {sorted(wanted)[0]!r} (for Megatron {weight!r})")
    return plan, dropped, kept


def hf_to_mcore_checkpoint(load: str | Path, save: str | Path, *, overwrite: bool = False,
                           progress: bool = True) -> dict:
    """Convert an HF folder into a Megatron distributed checkpoint at ``save``; returns counts."""
    source = HFFolder(load)
    hf = source.config
    family = family_for(hf.get("model_type"))
    hf = family.normalize_hf_config(hf)
    with _single_process():
        layout = model_layout(hf)
        plan, dropped, kept = plan_hf_groups(source, hf, layout, family)
        if dropped:
            _log(f"dropping {len(dropped)} HF tensors that are not part of the Megatron model "
                 f"(e.g. a vision tower), e.g. {dropped[0]!r}")
        if kept:
            _log(f"keeping {len(kept)} HF tensors outside the Megatron model (multi-token prediction) "
                 f"unchanged for the export, e.g. {kept[0]!r}")
        by_param = layout.chunks_by_param()
        items, lookup, owner = [], {}, {}
        for index, (names, dtypes) in enumerate(plan):
            for weight, dtype in dtypes.items():
                pieces = [p for c in by_param[weight] for p in c.split(MAX_CHUNK_BYTES // dtype.itemsize)]
                by_param[weight] = pieces
                for chunk in pieces:
                    item = dist_io.tensor_item(chunk, dtype)
                    items.append(item)
                    lookup[(chunk.key, chunk.offsets)] = chunk
                    owner[chunk.param] = index
        for key in layout.objects:
            items.append(dist_io.object_item(key))
        total = sum(_nbytes(torch.empty(c.sizes, dtype=i.tensor_data.properties.dtype, device="meta"))
                    for c, i in zip(lookup.values(), items))
        bar = tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
                   desc="hf-to-mcore", file=sys.stderr)
        cache = {"group": None, "tensors": {}, "returned": None}

        def resolve(item):
            if item.type == dist_io.WriteItemType.BYTE_IO:
                return dist_io.object_bytes(layout.objects[item.index.fqn])
            # torch's FileSystemWriter keeps a reference to every tensor it has written (for
            # its safetensors mode), so each returned tensor owns its storage and that storage
            # is released once DCP has written it (at the next call)
            if cache["returned"] is not None:
                cache["returned"].untyped_storage().resize_(0)
                cache["returned"] = None
            chunk = lookup[(item.index.fqn, tuple(item.index.offset))]
            group = owner[chunk.param]
            if cache["group"] != group:
                cache["tensors"] = {}  # free the previous group before reading the next
                names = plan[group][0]
                cache["tensors"] = family.weights.hf_to_mcore({n: source.read(n) for n in names}, hf,
                                                      partial=True)
                cache["group"] = group
            data = chunk.of(cache["tensors"][chunk.param])
            whole = (len(by_param[chunk.param]) == 1 and data.is_contiguous()
                     and data.untyped_storage().nbytes() == _nbytes(data))
            if whole:  # the weight's only chunk and sole owner of its storage: no copy
                cache["tensors"].pop(chunk.param)
            else:
                data = data.clone()
            cache["returned"] = data
            bar.update(_nbytes(data))
            bar.set_postfix(tensors=f"{group + 1}/{len(plan)}", refresh=False)
            return data

        with atomic_output(save, overwrite) as folder:
            dist_io.write_dist_checkpoint(folder, items, resolve)
            write_hf_config(folder, source.config)
            assets = copy_assets(find_assets(load, TOKENIZER_FILES + GENERATION_FILES), folder / ASSETS_DIR)
            if kept:
                write_kept_weights(source, kept, folder / ASSETS_DIR / KEPT_WEIGHTS)
        bar.close()
    return dict(groups=len(plan), chunks=len(items), dropped=len(dropped), kept=len(kept), bytes=total,
                assets=len(assets))


def write_kept_weights(source: HFFolder, names: list[str], path: Path) -> None:
    """The HF tensors ``names`` of ``source``, unchanged, into the safetensors file ``path``, one
    tensor in memory at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = SafetensorsWriter(path, [(n, source.meta(n).dtype, tuple(source.meta(n).shape)) for n in names])
    try:
        for name in names:
            writer.add(name, source.read(name))
        writer.close()
    finally:
        writer.file.close()


def _hf_output_config(hf: dict) -> dict:
    """The ``config.json`` for the converted weights: the family's ``hf_output_config`` (e.g. the
    text model of a multimodal config)."""
    config = family_for(hf.get("model_type")).hf_output_config(hf)
    if config.get("model_type") != hf.get("model_type"):
        models = ", ".join(config.get("architectures") or [config.get("model_type", "?")])
        _log(f"writing the {config.get('model_type')} model ({models}): parts of the {hf.get('model_type')} "
             "model outside the Megatron model (e.g. a vision tower) are not in the checkpoint")
    return config


def mcore_to_hf_checkpoint(load: str | Path, save: str | Path, *, model: str | None = None,
                           tokenizer_model: str | Path | None = None, max_shard_bytes: int = 5 * 2**30,
                           overwrite: bool = False, progress: bool = True) -> dict:
    """Convert a Megatron checkpoint (any layout) into an HF safetensors folder at ``save``, with
    the tokenizer and generation config the checkpoint keeps (``hf_assets``); the tokenizer files
    of ``tokenizer_model`` (a folder) replace the checkpoint's."""
    from megatron_longstraw.models.presets import resolve_hf_config

    folder = resolve_checkpoint_dir(load)
    assets = override_assets(checkpoint_assets(folder), tokenizer_assets(tokenizer_model))
    kept_file = assets.pop(KEPT_WEIGHTS, None)  # its tensors go into the shards
    kept = read_header(Path(kept_file)) if kept_file else {}
    if not any(name in assets for name in TOKENIZER_FILES):
        _log(f"--load {folder}: the checkpoint keeps no tokenizer files: the exported folder has none "
             "(pass --tokenizer-model FOLDER for a folder that serves)")
    hf = resolve_hf_config(model) if model else read_hf_config(folder)
    family = family_for(hf.get("model_type"))
    metadata = dist_io.read_metadata(folder)
    with _single_process():
        layout = model_layout(family.normalize_hf_config(hf))
        stored = metadata.state_dict_metadata
        for chunk in layout.chunks:
            if chunk.key not in stored:
                raise ValueError(f"--load {folder}: checkpoint lacks tensor {chunk.key!r} "
                                 f"(Megatron weight {chunk.param!r})")
            shape = tuple(getattr(stored[chunk.key], "size", ()))
            if shape != chunk.global_shape:
                raise ValueError(f"--load {folder}: tensor {chunk.key!r} has shape {shape}; the "
                                 f"config expects {chunk.global_shape}")
        keys = {c.key for c in layout.chunks}
        for key in stored:
            if key.startswith(("embedding.", "decoder.", "output_layer.")) and key not in keys \
                    and "/shard_" not in key:
                raise ValueError(f"--load {folder}: unexpected tensor {key!r} (not in the model "
                                 f"of {hf.get('_source', 'the config')})")
        by_param = layout.chunks_by_param()
        dtypes = {w: dist_io.stored_dtype(metadata, chunks[0].key) for w, chunks in by_param.items()}
        # the units converted together: one weight, or every expert of a layer whose HF tensor
        # stacks them (WeightMap.export_groups)
        groups = [tuple(g) for g in family.weights.export_groups(list(layout.params), hf)]
        outputs = {}  # group -> [(hf name, dtype, shape)]
        for group in groups:
            meta = family.weights.mcore_to_hf({w: torch.empty(layout.params[w], dtype=dtypes[w], device="meta")
                                               for w in group}, hf, checkpoint_layout=True)
            outputs[group] = [(n, t.dtype, tuple(t.shape)) for n, t in meta.items()]
        sizes = {g: sum(_nbytes(torch.empty(layout.params[w], dtype=dtypes[w], device="meta")) for w in g)
                 for g in groups}
        # shards of at most max_shard_bytes: the model's weights (converted), then the kept tensors
        shards, current, current_bytes = [], ([], []), 0
        units = [(0, g, sizes[g]) for g in groups] + [(1, n, e.nbytes) for n, e in kept.items()]
        for kind, key, size in units:
            if (current[0] or current[1]) and current_bytes + size > max_shard_bytes:
                shards.append(current)
                current, current_bytes = ([], []), 0
            current[kind].append(key)
            current_bytes += size
        shards.append(current)
        budget = max(sizes.values())
        total = sum(sizes.values()) + sum(e.nbytes for e in kept.values())
        bar = tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="mcore-to-hf", file=sys.stderr)
        weight_map, count = {}, 0
        with atomic_output(save, overwrite) as out:
            for number, (units_in_shard, kept_names) in enumerate(shards, start=1):
                file = SINGLE_NAME if len(shards) == 1 else \
                    f"model-{number:05d}-of-{len(shards):05d}.safetensors"
                specs = [spec for g in units_in_shard for spec in outputs[g]]
                specs += [(n, kept[n].dtype, kept[n].shape) for n in kept_names]
                writer = SafetensorsWriter(out / file, specs)
                try:
                    start = 0
                    while start < len(units_in_shard):  # read a batch of groups up to the budget
                        end, batch_bytes = start, 0
                        while end < len(units_in_shard) and (
                                end == start or batch_bytes + sizes[units_in_shard[end]] <= budget):
                            batch_bytes += sizes[units_in_shard[end]]
                            end += 1
                        batch = units_in_shard[start:end]
                        full = {w: torch.empty(layout.params[w], dtype=dtypes[w]) for g in batch for w in g}
                        try:
                            dist_io.read_chunks(folder, [(c.key, c.offsets, c.of(full[w]))
                                                         for w in full for c in by_param[w]])
                        except (Exception, CheckpointException) as err:  # torch's is a BaseException
                            raise ValueError(f"--load {folder}: checkpoint is corrupt or incomplete (reading "
                                             f"{sorted(full)[0]!r}: {dist_io.one_line(err)})") from None
                        for group in batch:
                            tensors = family.weights.mcore_to_hf({w: full.pop(w) for w in group}, hf,
                                                                 checkpoint_layout=True)
                            for name, _, _ in outputs[group]:
                                writer.add(name, tensors[name])
                                weight_map[name] = file
                                count += 1
                            del tensors
                            bar.update(sizes[group])
                            bar.set_postfix(tensors=count, refresh=False)
                        start = end
                    for name in kept_names:  # unchanged, one at a time
                        writer.add(name, read_tensor(kept[name]))
                        weight_map[name] = file
                        count += 1
                        bar.update(kept[name].nbytes)
                    writer.close()
                finally:
                    writer.file.close()
            if len(shards) > 1:
                (out / INDEX_NAME).write_text(json.dumps(
                    {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
            (out / "config.json").write_text(json.dumps(_hf_output_config(hf), indent=2) + "\n")
            copy_assets(assets, out)
        bar.close()
    return dict(tensors=count, shards=len(shards), bytes=total, kept=len(kept), assets=len(assets))
