"""The layer-by-layer I/O of an offloaded step, timed for `aio` and for DeepSpeed's aio handle.

Two patterns on one file per tensor (as DeepSpeed's parameter swapper keeps them), TinyLlama-like
layers (7 bf16 matrices of 8-22 MiB) scaled down when the size given does not hold them:

- fetch: forward reads every layer with `window` layers in flight (the one about to be used and
  the next), waiting for each layer just before its use. Parameters on the critical path.
- optimizer: each layer read `window` ahead and written back in place once used, reads and
  write-backs in flight together (the optimizer's swap-in / swap-out).

The tools run alternately within each round, each on files it wrote itself (untimed), so the
drift of a shared disk hits both alike. Every file is evicted from the page cache before a read
round and read through O_DIRECT. After each transfer the first and last byte of every tensor are
checked, and after each round the whole of the buffers still held.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import aio
from aio import device_pauses
from infinity.cli import nvme_measure as bench
from infinity.errors import described

HIDDEN, INTERMEDIATE = 2048, 5632  # TinyLlama-1.1B (k and v kept square: 8-22 MiB tensors)
LAYERS = 8
WINDOW = 2
PATTERNS = ("fetch", "optimizer")


def layer_shapes(hidden: int = HIDDEN, intermediate: int = INTERMEDIATE) -> list[tuple[int, ...]]:
    """q, k, v, o, gate, up, down of one decoder layer (the bf16 matrices; norms left out)."""
    return [spec.shape for spec in bench.layer_tensors(hidden, intermediate)
            if spec.dtype == torch.bfloat16]


def plan(nbytes: int) -> list[tuple[int, ...]]:
    """The shapes of one layer such that LAYERS layers fit in `nbytes`: TinyLlama's when they do,
    else both dimensions scaled alike (multiples of 64)."""
    full = sum(math.prod(s) * 2 for s in layer_shapes()) * LAYERS
    if nbytes >= full:
        return layer_shapes()
    scale = math.sqrt(nbytes / full)
    hidden, intermediate = (max(64, int(dim * scale) // 64 * 64) for dim in (HIDDEN, INTERMEDIATE))
    if sum(math.prod(s) * 2 for s in layer_shapes(hidden, intermediate)) * LAYERS > nbytes:
        raise ValueError(f"{nbytes} bytes cannot hold {LAYERS} layers of 7 tensors "
                         "of at least 64x64")
    return layer_shapes(hidden, intermediate)


def _fill_value(layer: int, tensor: int) -> int:
    return (layer * 7 + tensor) % 251 + 1


class _Tool:
    """Transfers of a layer's tensors as one group; `finish` returns when the group is done."""

    name: str
    files_of: str  # the tool whose files it uses: itself, unless it only varies another's buffers

    def buffer(self, nbytes: int) -> torch.Tensor: ...
    def start(self, op: str, buffers: Sequence[torch.Tensor], paths: Sequence[str]) -> Any: ...
    def finish(self, group: Any) -> None: ...
    def close(self) -> None: ...


class OursTool(_Tool):
    """One aio.Handle; a group is the list of its Requests. With small_pages, the buffers are
    ordinary memory faulted in 4 KiB pages (what aligned_empty gave before it used huge pages;
    see [Note: physically contiguous buffers] in aio/buffers.py); such a tool reads and writes
    the files of the tool named `files_of`."""

    def __init__(self, config: bench.EngineConfig, *, small_pages: bool = False) -> None:
        self.handle = config.open()
        self.files_of = f"aio/{self.handle.backend}"
        self.name = self.files_of + (" 4K pages" if small_pages else "")
        self.small_pages = small_pages

    def buffer(self, nbytes: int) -> torch.Tensor:
        if not self.small_pages:
            return aio.aligned_empty(nbytes)
        raw = torch.empty(nbytes + aio.buffers.PAGE_NBYTES, dtype=torch.uint8)
        shift = (-raw.data_ptr()) % aio.buffers.PAGE_NBYTES
        return raw[shift:shift + nbytes]

    def start(self, op, buffers, paths):
        submit = self.handle.read if op == "read" else self.handle.write
        return [(submit(buf, path), buf.nbytes) for buf, path in zip(buffers, paths, strict=True)]

    def finish(self, group) -> None:
        for request, nbytes in group:
            moved = request.wait()
            if moved != nbytes:
                raise OSError(f"{request.path}: {moved} of {nbytes} bytes moved")

    def close(self) -> None:
        self.handle.close()


class DeepSpeedTool(_Tool):
    """DeepSpeed's aio_handle, whose wait() waits for everything it has in flight: each group gets
    a handle of its own from a pool, so waiting for one layer leaves the next one in flight."""

    def __init__(self, config: bench.EngineConfig, groups: int) -> None:
        from deepspeed.ops.op_builder import AsyncIOBuilder  # optional: see deepspeed_tool()

        module = AsyncIOBuilder().load(verbose=False)
        self.handles = [module.aio_handle(config.block_size, config.queue_depth, False, True,
                                          config.threads) for _ in range(groups)]
        self.free = list(range(groups))
        self.name = self.files_of = "deepspeed"

    def buffer(self, nbytes: int) -> torch.Tensor:
        # page-locked, or DeepSpeed copies through a bounce buffer of its own
        return self.handles[0].new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))

    def start(self, op, buffers, paths):
        index = self.free.pop()
        handle = self.handles[index]
        transfer = handle.async_pread if op == "read" else handle.async_pwrite
        for buf, path in zip(buffers, paths, strict=True):
            if transfer(buf, path) != 0:
                raise OSError(f"deepspeed {op} of {path} refused")
        return index, len(buffers)

    def finish(self, group) -> None:
        index, count = group
        done = self.handles[index].wait()
        self.free.append(index)
        if done != count:
            raise OSError(f"deepspeed completed {done} of {count} transfers")

    def close(self) -> None:
        self.handles.clear()


def deepspeed_tool(config: bench.EngineConfig, groups: int) -> DeepSpeedTool | str:
    """DeepSpeed's handle, or why it cannot be used here (it is optional)."""
    try:
        return DeepSpeedTool(config, groups)
    except Exception as exc:  # ImportError, or its JIT build failing (no libaio-dev)
        return described(exc)


@dataclass(slots=True)
class Run:
    tool: str
    pattern: str
    read_nbytes: int
    write_nbytes: int
    seconds: float
    device_requests: int | None  # requests the block device completed meanwhile (all processes)
    device_nbytes: int | None

    @property
    def gbps(self) -> float:
        return (self.read_nbytes + self.write_nbytes) / self.seconds / bench.GB

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "gbps": self.gbps}


class LayerFiles:
    """One tool's files: LAYERS x 7 tensor files, and window + 1 buffer slots of a layer each."""

    def __init__(self, tool: _Tool, directory: str, shapes: Sequence[tuple[int, ...]]) -> None:
        self.tool = tool
        self.sizes = [math.prod(shape) * 2 for shape in shapes]
        tag = tool.files_of.replace("/", "-")
        self.paths = [[os.path.join(directory, f"{tag}.{layer}.{t}") for t in range(len(shapes))]
                      for layer in range(LAYERS)]
        self.slots = [[tool.buffer(n) for n in self.sizes] for _ in range(WINDOW + 1)]
        if tool.files_of != tool.name:
            return  # the files of another tool, written by it
        for layer in range(LAYERS):  # untimed: every file written once, one layer at a time
            for t, buf in enumerate(self.slots[0]):
                buf.fill_(_fill_value(layer, t))
            tool.finish(tool.start("write", self.slots[0], self.paths[layer]))

    def start(self, op: str, layer: int) -> Any:
        return self.tool.start(op, self.slots[layer % len(self.slots)], self.paths[layer])

    def finish_read(self, layer: int, group: Any) -> None:
        self.tool.finish(group)
        for t, buf in enumerate(self.slots[layer % len(self.slots)]):
            want = _fill_value(layer, t)
            if buf[0].item() != want or buf[-1].item() != want:
                raise OSError(f"{self.paths[layer][t]}: read back {buf[0].item()}, not {want}")

    def check_slots(self, last: int) -> None:
        """The whole of every buffer still holding layer `last` or those before it."""
        for layer in range(max(0, last - len(self.slots) + 1), last + 1):
            for t, buf in enumerate(self.slots[layer % len(self.slots)]):
                if not bool((buf == _fill_value(layer, t)).all()):
                    raise OSError(f"{self.paths[layer][t]}: read back wrong bytes")

    def evict(self) -> None:
        for layer_paths in self.paths:
            for path in layer_paths:
                bench.drop_page_cache(path)


def extents(paths: Sequence[str]) -> list[int] | None:
    """Extents of each file as `filefrag` counts them, or None where it is not installed."""
    filefrag = shutil.which("filefrag")
    if filefrag is None:
        return None
    out = subprocess.run([filefrag, *paths], capture_output=True, text=True, check=False).stdout
    return [int(line.rsplit(":", 1)[1].split()[0]) for line in out.splitlines() if "extent" in line]


def fetch(files: LayerFiles) -> tuple[int, int]:
    """Forward: each layer waited for just before use, the next one in flight meanwhile."""
    groups: dict[int, Any] = {}
    issued = 0
    for use in range(LAYERS):
        while issued < min(LAYERS, use + WINDOW):
            groups[issued] = files.start("read", issued)
            issued += 1
        files.finish_read(use, groups.pop(use))
    return LAYERS * sum(files.sizes), 0


def optimizer(files: LayerFiles) -> tuple[int, int]:
    """Each layer read ahead, then written back in place while the next ones are read."""
    reads: dict[int, Any] = {}
    writes: dict[int, Any] = {}
    slots = len(files.slots)
    issued = 0
    for use in range(LAYERS):
        while issued < min(LAYERS, use + WINDOW):
            if issued % slots in writes:  # the slot's buffer is still being written back
                files.tool.finish(writes.pop(issued % slots))
            reads[issued] = files.start("read", issued)
            issued += 1
        files.finish_read(use, reads.pop(use))
        writes[use % slots] = files.start("write", use)
    for group in writes.values():
        files.tool.finish(group)
    return LAYERS * sum(files.sizes), LAYERS * sum(files.sizes)


RUNNERS: dict[str, Callable[[LayerFiles], tuple[int, int]]] = {
    "fetch": fetch, "optimizer": optimizer}


def measure(config: bench.EngineConfig, directory: str, nbytes: int, rounds: int, *,
            with_deepspeed: bool = True, on_progress: Callable[[int], None] | None = None
            ) -> tuple[list[Run], dict[str, Any]]:
    """`rounds` rounds of both patterns for ours, ours with 4 KiB-page buffers, and DeepSpeed's
    handle when importable, the tools' order alternating from round to round. Ours and
    DeepSpeed's files take nbytes / 2 each (all of it without DeepSpeed)."""
    tools: list[_Tool] = [OursTool(config), OursTool(config, small_pages=True)]
    skipped = None
    if with_deepspeed:
        ds = deepspeed_tool(config, WINDOW + 2)
        if isinstance(ds, str):
            skipped = ds
        else:
            tools.append(ds)
    shapes = plan(nbytes // len({tool.files_of for tool in tools}))
    info = {"layers": LAYERS, "window": WINDOW, "shapes": [list(s) for s in shapes],
            "tools": [t.name for t in tools], "deepspeed_skipped": skipped}
    stat_path = device_pauses.stat_path(directory)
    runs: list[Run] = []
    try:
        files = [LayerFiles(tool, directory, shapes) for tool in tools]
        info["extents"] = {f.tool.name: extents([p for layer in f.paths for p in layer])
                           for f in files if f.tool.files_of == f.tool.name}
        for round_ in range(rounds):
            for tool_files in files if round_ % 2 == 0 else files[::-1]:
                for pattern, runner in RUNNERS.items():
                    tool_files.evict()
                    before = stat_path and device_pauses.read_sample(stat_path)
                    start = time.perf_counter()
                    read_nbytes, write_nbytes = runner(tool_files)
                    seconds = time.perf_counter() - start
                    after = stat_path and device_pauses.read_sample(stat_path)
                    tool_files.check_slots(LAYERS - 1)
                    requests, moved = ((after.requests - before.requests,
                                        after.nbytes - before.nbytes)
                                       if before and after else (None, None))
                    runs.append(Run(tool_files.tool.name, pattern, read_nbytes, write_nbytes,
                                    seconds, requests, moved))
                    if on_progress:
                        on_progress(1)
    finally:
        for tool in tools:
            tool.close()
    return runs, info
