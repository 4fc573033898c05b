"""`load`: a local Hugging Face checkpoint streamed into the engine's store, never whole in memory.

Order: index the checkpoint (every file present and whole), build the model on meta from
config.json, match every parameter to a checkpoint tensor (names, shapes), lay it out as
`initialize` will, then stream unit by unit into the store through one window-sized buffer
pair (read, convert). All errors of the checkpoint come before the store is opened.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import aio
from infinity.config import load_config
from infinity.engine import (
    Layout,
    Placed,
    choose_model_precision,
    lay_out,
    open_store,
)
from infinity.errors import CheckpointError
from infinity.models._meta import build_on_meta
from infinity.models._safetensors import ShardReader, TensorRecord, index_checkpoint
from infinity.store import TensorStore
from infinity.zero import FetchUnit, buffers_to

logger = logging.getLogger(__name__)

DEFAULT_WINDOW = 256 << 20
_MIN_WINDOW = 1 << 20
_CHUNK_ALIGN = 4096  # elements: chunk bytes stay multiples of 4 KiB whatever the dtype


def load(path: str | os.PathLike[str], config: dict[str, Any] | str | os.PathLike[str], *,
         window: int = DEFAULT_WINDOW,
         prepare: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
         progress: Callable[[int], None] | None = None) -> torch.nn.Module:
    """The `transformers` model of the local directory `path` (config.json with
    model.safetensors or model.safetensors.index.json and its shards), its parameters already
    in the store that `infinity.initialize(model, config)` adopts without a copy.

    Parameters stream tensor by tensor, in slices, through `window` bytes of buffers (read
    and converted), into the store's home tier of parameters (NVMe with offload_param
    "nvme"): peak memory is the window plus the store's host tier (the engine's arena, touched
    when the store opens; the whole model when parameters live in host memory), see
    docs/scale.md. Values are converted to the config's precision on the way (bf16 shards
    into fp32 parameters, or the reverse). Tied weights (lm_head = embed_tokens) load once.

    Until `initialize`, the parameters hold empty placeholders: the model is for training
    through the engine (pass it the same config). The store and its layout travel in
    `model.infinity_placed` (an `infinity.engine.Placed`), which `initialize` adopts and
    removes.

    `prepare`, when given, takes the model built on meta (checkpoint names already matched)
    and returns the model to place, e.g. wrapped with LoRA adapters and its base frozen
    (`requires_grad` decides which units get optimizer state). Parameters it adds must hold
    real values (not meta): they are streamed into the store with the checkpoint's.
    `progress`, when given, is called with the bytes of each unit once it is in the store.

    Raises CheckpointError naming the file and tensor (missing shard, tensor absent from its
    shard, truncated or corrupt file, shape unlike config.json, a tensor the model lacks, a
    parameter the checkpoint lacks), ConfigError and BudgetError; all before any value moves.
    """
    directory = os.fspath(path)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: not a directory (only local checkpoints are loaded)", path=directory)
    if window < _MIN_WINDOW:
        raise ValueError(f"window = {window} bytes; at least {_MIN_WINDOW} (1 MiB)")
    records = index_checkpoint(directory)
    probe = load_config(config, model=None)
    precision, device = choose_model_precision(probe)
    model = build_on_meta(directory, precision.compute)
    sources, buffers = _match(model, records, directory)
    if prepare is not None:
        model = _prepared(model, prepare, sources)
    conf = load_config(config, model=model)
    layout = lay_out(model, conf, precision, device, meta_ok=True)
    store = open_store(layout, conf)
    started = time.perf_counter()
    try:
        _stream(layout, store, sources, window, progress or (lambda nbytes: None))
        _replace_meta(model, layout)
        for module, name, record in buffers:
            _copy_buffer(module, name, record)
        buffers_to(model, device)
    except BaseException:
        store.close()
        raise
    nbytes = sum(u.nbytes for u in layout.units)
    logger.info("models: %s loaded into the %s tier (%d bytes, %d units) in %.1f s through a %d-byte window",
                directory, layout.plan.param_home.label, nbytes, len(layout.units),
                time.perf_counter() - started, window)
    model.infinity_placed = Placed(layout, store)  # for initialize: [Note: placed models]
    return model


def _patterns(model: torch.nn.Module, attribute: str) -> list[re.Pattern]:
    return [re.compile(p) for p in (getattr(model, attribute, None) or [])]


def _match(model: torch.nn.Module, records: dict[str, TensorRecord], directory: str
           ) -> tuple[dict[int, TensorRecord], list[tuple[torch.nn.Module, str, TensorRecord]]]:
    """Checkpoint tensor of every parameter (by id; a tied parameter by any of its names) and of
    every buffer the checkpoint holds. Raises CheckpointError for a tensor of the wrong shape,
    one the model lacks, or a parameter the checkpoint lacks."""
    aliases: dict[int, list[str]] = {}
    params: dict[str, torch.nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
        params[name] = p
    buffer_names = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    config_json = os.path.join(directory, "config.json")
    sources: dict[int, TensorRecord] = {}
    buffers = []
    ignore_unexpected = _patterns(model, "_keys_to_ignore_on_load_unexpected")
    for name, record in sorted(records.items()):  # the first error by name: the same on every run
        if name in params:
            p = params[name]
            if record.shape != p.shape:
                raise CheckpointError(
                    f"{record.path}: tensor {name!r} has shape {tuple(record.shape)}, the model built from "
                    f"{config_json} has {tuple(p.shape)}", path=record.path, tensor=name)
            _check_kind(record, p.dtype)
            sources.setdefault(id(p), record)
        elif name in buffer_names:
            module_name, _, buffer = name.rpartition(".")
            found = model.get_submodule(module_name)._buffers[buffer]
            if found is None or found.shape != record.shape:
                raise CheckpointError(
                    f"{record.path}: tensor {name!r} has shape {tuple(record.shape)}, the model's buffer has "
                    f"{None if found is None else tuple(found.shape)}", path=record.path, tensor=name)
            _check_kind(record, found.dtype)
            buffers.append((model.get_submodule(module_name), buffer, record))
        elif not any(pattern.search(name) for pattern in ignore_unexpected):
            raise CheckpointError(f"{record.path}: tensor {name!r} is not a parameter of the model built from "
                                  f"{config_json} ({type(model).__name__})", path=record.path, tensor=name)
    ignore_missing = _patterns(model, "_keys_to_ignore_on_load_missing")
    for key, names in aliases.items():
        if key not in sources and not any(pat.search(n) for n in names for pat in ignore_missing):
            raise CheckpointError(f"{directory}: the checkpoint has no tensor for parameter {names[0]!r} of "
                                  f"{type(model).__name__}" + (f" (nor {names[1:]})" if len(names) > 1 else ""),
                                  path=directory, tensor=names[0])
    return sources, buffers


def _check_kind(record: TensorRecord, dtype: torch.dtype) -> None:
    """Values convert between precisions of one kind only: integers or booleans loaded into a
    floating-point tensor (or the reverse) mean a damaged or foreign checkpoint."""
    if record.dtype.is_floating_point != dtype.is_floating_point:
        raise CheckpointError(f"{record.path}: tensor {record.name!r} is {record.dtype}, the "
                              f"model's is {dtype}: not the same kind of number",
                              path=record.path, tensor=record.name)


def _prepared(model: torch.nn.Module, prepare: Callable[[torch.nn.Module], torch.nn.Module],
              sources: dict[int, TensorRecord]) -> torch.nn.Module:
    """`prepare(model)`, checked: every parameter it added holds values to stream."""
    before = {id(p) for p in model.parameters()}
    prepared = prepare(model)
    for name, p in prepared.named_parameters():
        if id(p) not in before and id(p) not in sources and p.device.type == "meta":
            raise ValueError(f"prepare added parameter {name!r} on the meta device: it has no values to load "
                             f"(give the parameters it adds real values)")
    return prepared


def _stream(layout: Layout, store: TensorStore, sources: dict[int, TensorRecord], window: int,
            progress: Callable[[int], None]) -> None:
    """Put every unit into the store, slice by slice, through two buffers within `window`."""
    widest_src = max((r.dtype.itemsize for r in sources.values()), default=4)
    widest_dst = max((u.dtype.itemsize for u in layout.units), default=4)
    chunk_numel = window // (widest_src + widest_dst) // _CHUNK_ALIGN * _CHUNK_ALIGN
    staging = aio.aligned_empty(chunk_numel * widest_src)
    converted = aio.aligned_empty(chunk_numel * widest_dst)
    reader = ShardReader()
    try:
        for unit in layout.units:
            out = converted[:chunk_numel * unit.dtype.itemsize].view(unit.dtype)
            store.put_chunks(unit.key, (unit.numel,), unit.dtype,
                             _unit_chunks(unit, sources, reader, out, staging), layout.plan.param_home)
            progress(unit.nbytes)
    finally:
        reader.close()


def _unit_chunks(unit: FetchUnit, sources: dict[int, TensorRecord], reader: ShardReader,
                 out: torch.Tensor, staging: torch.Tensor) -> Iterator[torch.Tensor]:
    """The unit's flat values in pieces of at most out.numel() elements, each read from the
    slots' checkpoint tensors and converted into `out` (reused: consumed before the next)."""
    for first in range(0, unit.numel, out.numel()):
        n = min(out.numel(), unit.numel - first)
        for slot in unit.slots:
            count = slot.shape.numel()
            lo, hi = max(first, slot.offset), min(first + n, slot.offset + count)
            if lo >= hi:
                continue
            record = sources.get(id(slot.param))
            if record is None and slot.param.device.type != "meta":  # added by `prepare`: its own values
                out[lo - first:hi - first].copy_(slot.param.detach().reshape(-1)[lo - slot.offset:hi - slot.offset])
                continue
            if record is None:  # a parameter the model may leave uninitialised: zeros
                out[lo - first:hi - first].zero_()
                continue
            raw = staging[:(hi - lo) * record.dtype.itemsize]
            reader.read(record, lo - slot.offset, raw)
            out[lo - first:hi - first].copy_(raw.view(record.dtype))
        yield out[:n]


def _replace_meta(model: torch.nn.Module, layout: Layout) -> None:
    """Give every parameter an empty placeholder (a meta tensor cannot take .data from another
    device: each meta Parameter is replaced, in every module that holds it, and in its slot)."""
    placeholders: dict[torch.dtype, torch.Tensor] = {}
    fresh: dict[int, torch.nn.Parameter] = {}
    for unit in layout.units:
        if unit.compute_dtype not in placeholders:
            placeholders[unit.compute_dtype] = torch.empty(0, dtype=unit.compute_dtype, device=layout.device)
        for slot in unit.slots:
            new = torch.nn.Parameter(placeholders[unit.compute_dtype], requires_grad=slot.param.requires_grad)
            fresh[id(slot.param)] = new
            slot.param = new
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) in fresh:
                module._parameters[name] = fresh[id(p)]


def _copy_buffer(module: torch.nn.Module, name: str, record: TensorRecord) -> None:
    """A buffer saved in the checkpoint (small: read whole; its shape was checked by _match)."""
    buf = module._buffers[name]
    raw = torch.empty(record.nbytes, dtype=torch.uint8)
    reader = ShardReader()
    try:
        reader.read(record, 0, raw)
    finally:
        reader.close()
    module._buffers[name] = raw.view(record.dtype).view(record.shape).to(buf.dtype)
