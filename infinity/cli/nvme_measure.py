"""Measuring the aio engine: sequential GB/s, small-request cost, a training-like mix, and fio.

Used by `infinity/cli/nvme_bench.py` (the `infinity-nvme-bench` command) and `tools/bench_store.py`:
benchmark code, kept out of the `aio` package. Units: bytes, seconds, and GB/s in decimal
gigabytes (1e9 bytes/s), as fio and disk vendors count them.

[Note: honest reads] A read measures the device only if nothing comes from the page cache and
nothing comes from unwritten extents (which ext4 returns as zeros without touching the disk).
So every file read here was first written in full (`lay_out`), the engine reads it through
O_DIRECT, and `drop_page_cache` flushes and evicts the file's cached pages before each timed
read. Timed writes overwrite that laid-out file, which is the steady state of a swap file.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from aio.buffers import aligned_empty
from aio.device_pauses import DevicePauses, Pauses
from aio.handle import Handle
from aio.request import Request
from aio.swap_file import Extent, SwapFile

logger = logging.getLogger(__name__)

GB = 1e9  # decimal gigabyte: GB/s figures are bytes / seconds / GB
SMALL_NBYTES = 4096  # request size of the per-request overhead test
# [Note: submitted ahead] The engine caps the pieces at the device at queue_depth per queue
# (fio's iodepth) and starts a queued piece the moment one completes, in its own thread. So the
# benchmarks hand it requests of REQUEST_NBYTES (cut into block_size pieces), keep about `ahead`
# times queue_depth * threads pieces submitted, and wait for the oldest first: the device never
# runs dry while Python waits on a slow request (on a shared disk p99 is 10-30x p50) or pays its
# own cost per request. Latency is from submission, time queued in the engine included.
REQUEST_NBYTES = 4 << 20  # sequential request size unless block_size is larger: a tensor slab
SUBMIT_AHEAD = 2  # sequential runs
SMALL_AHEAD = 8  # 4 KiB reads: cheap to hold, and most exposed to stragglers
FIO_ENGINES = ("io_uring", "libaio")

Progress = Callable[[int], None]  # called with the bytes (or requests) finished since last call


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One setting of the engine's knobs, as `aio.Handle` takes them."""

    block_size: int = 1 << 20  # bytes per piece (fio's bs); requests are cut into pieces
    queue_depth: int = 32  # pieces in flight per queue
    threads: int = 1  # queues (each with its own kernel context and progress thread)
    backend: str = "auto"  # "auto", "io_uring", "libaio" or "threads"

    @property
    def in_flight(self) -> int:
        """Pieces at the device when every queue is full (fio: iodepth * numjobs)."""
        return self.queue_depth * self.threads

    def open(self) -> Handle:
        return Handle(self.block_size, self.queue_depth, self.threads, self.backend)

    def aio_section(self) -> dict[str, Any]:
        """The `aio` block of a DeepSpeed-style engine config (thread_count for old readers)."""
        return {"aio": {
            "block_size": self.block_size,
            "queue_depth": self.queue_depth,
            "intra_op_parallelism": self.threads,
            "thread_count": self.threads,
            "backend": self.backend,
            "single_submit": False,
            "overlap_events": True,
        }}


@dataclass(slots=True)
class Throughput:
    """One timed run: `requests` transfers of `request_nbytes` (the last may be shorter)."""

    tool: str  # "aio/<backend>" or "fio/<ioengine>"
    op: str  # "read", "write" or "randread"
    nbytes: int  # bytes moved
    seconds: float  # wall time from the first submission to the last completion
    requests: int
    request_nbytes: int
    p50_s: float  # latency of one request, submission to completion seen
    p99_s: float
    cpu_seconds: float | None = None  # CPU time of the whole process (all threads), if known

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / GB if self.seconds > 0 else 0.0

    @property
    def us_per_request(self) -> float:
        """Wall time over requests: the cost of one request at this queue depth."""
        return self.seconds / self.requests * 1e6 if self.requests else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "gbps": self.gbps,
                "us_per_request": self.us_per_request}


class Summary(NamedTuple):
    """Median and range of repeated measurements (the disk may be shared and noisy)."""

    median: float
    low: float
    high: float


def summarize(values: Iterable[float]) -> Summary:
    values = list(values)
    return Summary(statistics.median(values), min(values), max(values))


# -- files -------------------------------------------------------------------------------------


def drop_page_cache(path: str) -> None:
    """Flush and evict `path`'s pages from the page cache. See [Note: honest reads]."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def filesystem_of(path: str) -> str:
    """'<fstype> on <device>' for the mount holding `path`, from /proc/self/mounts."""
    real, best = os.path.realpath(path), ("", "?", "?")
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                device, mount, fstype = line.split()[:3]
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best[0]):
                    best = (mount, device, fstype)
    except OSError:
        pass
    return f"{best[2]} on {best[1]}"


def lay_out(handle: Handle, path: str, nbytes: int, on_progress: Progress | None = None) -> None:
    """Create `path` with `nbytes` preallocated and written in full (untimed set-up)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)
    sequential(handle, path, nbytes, "write", on_progress=on_progress)


# -- the engine ----------------------------------------------------------------------------------


def _pattern_buffer(nbytes: int) -> torch.Tensor:
    """An aligned buffer of random bytes (1 MiB repeated, as fio does) with every page touched,
    so timing never includes page faults and nothing is trivially compressible."""
    buffer = aligned_empty(nbytes)
    chunk = min(nbytes, 1 << 20)
    buffer[:chunk].random_(generator=torch.Generator().manual_seed(0))
    for offset in range(chunk, nbytes, chunk):
        buffer[offset:offset + chunk].copy_(buffer[:min(chunk, nbytes - offset)])
    return buffer


def sequential(handle: Handle, path: str, nbytes: int, op: str, *,
               request_nbytes: int | None = None, ahead: int = SUBMIT_AHEAD,
               on_progress: Progress | None = None) -> Throughput:
    """Read or write `path` from offset 0 to `nbytes` in requests of `request_nbytes` (default
    REQUEST_NBYTES or block_size if larger) from one aligned ring buffer; see
    [Note: submitted ahead]."""
    if op not in ("read", "write"):
        raise ValueError(f"op must be 'read' or 'write', got {op!r}")
    request_nbytes = request_nbytes or max(handle.block_size, REQUEST_NBYTES)
    count = math.ceil(nbytes / request_nbytes)
    device_nbytes = handle.queue_depth * handle.threads * handle.block_size
    in_flight = min(count, max(2, math.ceil(ahead * device_nbytes / request_nbytes)))
    ring = _pattern_buffer(in_flight * request_nbytes)
    submit = handle.read if op == "read" else handle.write
    latencies = np.empty(count)
    pending: collections.deque[tuple[int, float, Any, int]] = collections.deque()

    def finish_oldest() -> None:
        index, started, request, length = pending.popleft()
        moved = request.wait()
        latencies[index] = time.perf_counter() - started
        if moved != length:
            raise OSError(f"{op} of {path} moved {moved} of {length} bytes")
        if on_progress:
            on_progress(length)

    cpu0, start = time.process_time(), time.perf_counter()
    for index in range(count):
        if len(pending) == in_flight:
            finish_oldest()
        offset = index * request_nbytes
        length = min(request_nbytes, nbytes - offset)
        slot = (index % in_flight) * request_nbytes
        pending.append((index, time.perf_counter(), submit(ring[slot:slot + length], path, offset),
                        length))
    while pending:
        finish_oldest()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu0
    return Throughput(f"aio/{handle.backend}", op, nbytes, seconds, count, request_nbytes,
                      *np.percentile(latencies, [50, 99]).tolist(), cpu)


def small_reads(handle: Handle, path: str, count: int, *, request_nbytes: int = SMALL_NBYTES,
                ahead: int = SMALL_AHEAD, seed: int = 0) -> Throughput:
    """`count` reads of `request_nbytes` at random aligned offsets of `path` (already written),
    queue_depth * threads at the device (see [Note: submitted ahead]): the per-request cost of
    the whole path, Python included."""
    blocks = os.path.getsize(path) // request_nbytes
    if blocks == 0 or count <= 0:
        raise ValueError(f"need a file of at least {request_nbytes} bytes and count > 0")
    offsets = (np.random.default_rng(seed).integers(0, blocks, count) * request_nbytes).tolist()
    in_flight = min(count, ahead * handle.queue_depth * handle.threads)
    ring = _pattern_buffer(in_flight * request_nbytes)
    views = [ring[i * request_nbytes:(i + 1) * request_nbytes] for i in range(in_flight)]
    latencies = np.empty(count)
    pending: collections.deque[tuple[int, float, Any]] = collections.deque()
    drop_page_cache(path)
    cpu0, start = time.process_time(), time.perf_counter()
    for index, offset in enumerate(offsets):
        if len(pending) == in_flight:
            done, started, request = pending.popleft()
            request.wait()
            latencies[done] = time.perf_counter() - started
        pending.append((index, time.perf_counter(),
                        handle.read(views[index % in_flight], path, offset)))
    while pending:
        done, started, request = pending.popleft()
        request.wait()
        latencies[done] = time.perf_counter() - started
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu0
    return Throughput(f"aio/{handle.backend}", "randread", count * request_nbytes, seconds, count,
                      request_nbytes, *np.percentile(latencies, [50, 99]).tolist(), cpu)


def pick_best(scored: Sequence[tuple[EngineConfig, float]],
              tolerance: float = 0.05) -> EngineConfig:
    """The config with the highest score, or, among those within `tolerance` of it (noise), the
    one with the least memory in flight (block_size * queue_depth * threads), then fewest
    threads."""
    if not scored:
        raise ValueError("nothing to pick from")
    top = max(score for _, score in scored)
    near = [config for config, score in scored if score >= top * (1 - tolerance)]
    return min(near, key=lambda c: (c.block_size * c.in_flight, c.threads, c.queue_depth))


# -- a training-like mix -------------------------------------------------------------------------

HIDDEN, INTERMEDIATE = 4096, 11008  # a 7B-class transformer layer
MIN_LAYERS = 4
DIM_STEP = 64


class TensorSpec(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def layer_tensors(hidden: int = HIDDEN, intermediate: int = INTERMEDIATE) -> list[TensorSpec]:
    """One decoder layer's weights (torch Linear layout [out, in]): bf16 matrices, fp32 norms."""
    bf16, fp32 = torch.bfloat16, torch.float32
    return [
        TensorSpec("input_layernorm", (hidden,), fp32),
        *(TensorSpec(f"self_attn.{p}_proj", (hidden, hidden), bf16) for p in "qkvo"),
        TensorSpec("post_attention_layernorm", (hidden,), fp32),
        TensorSpec("mlp.gate_proj", (intermediate, hidden), bf16),
        TensorSpec("mlp.up_proj", (intermediate, hidden), bf16),
        TensorSpec("mlp.down_proj", (hidden, intermediate), bf16),
    ]


def _capacity(specs: Sequence[TensorSpec], alignment: int = 4096) -> int:
    return sum(-(-spec.nbytes // alignment) * alignment for spec in specs)


def plan_layers(nbytes: int) -> tuple[list[TensorSpec], int]:
    """Layer tensors and how many layers fit in `nbytes`: real 7B shapes when MIN_LAYERS fit,
    else both dimensions scaled down alike (multiples of 64) until they do."""
    specs = layer_tensors()
    if nbytes // _capacity(specs) < MIN_LAYERS:
        scale = math.sqrt(nbytes / MIN_LAYERS / _capacity(specs))
        hidden = max(DIM_STEP, int(HIDDEN * scale) // DIM_STEP * DIM_STEP)
        intermediate = max(DIM_STEP, int(INTERMEDIATE * scale) // DIM_STEP * DIM_STEP)
        specs = layer_tensors(hidden, intermediate)
        while nbytes // _capacity(specs) < MIN_LAYERS and hidden > DIM_STEP:
            hidden -= DIM_STEP
            intermediate = max(DIM_STEP, intermediate - DIM_STEP)
            specs = layer_tensors(hidden, intermediate)
    layers = nbytes // _capacity(specs)
    if layers < MIN_LAYERS:
        raise ValueError(f"--mix needs room for {MIN_LAYERS} layers of at least "
                         f"{_capacity(specs)} bytes; {nbytes} bytes is too small")
    return specs, layers


def mix_schedule(layers: int, passes: int) -> list[tuple[int, bool]]:
    """(layer, written back after use) for `passes` training steps: forward uses layers in order
    and only reads them; backward uses them in reverse and the optimizer writes each back."""
    step = [(layer, False) for layer in range(layers)]
    step += [(layer, True) for layer in reversed(range(layers))]
    return step * passes


@dataclass(slots=True)
class MixResult:
    """Reads of the next layers and write-back of finished ones, all in flight together."""

    backend: str
    layers: int
    layer_nbytes: int
    tensors: list[dict[str, Any]]  # name, shape, dtype, nbytes of one layer's tensors
    window: int  # layers read ahead of the one in use
    passes: int  # training steps replayed (forward + backward each)
    read_nbytes: int
    write_nbytes: int
    seconds: float
    paused: Pauses | None  # the disk's pauses in the timed span (None: no device counters)

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "read_gbps": self.read_nbytes / self.seconds / GB,
                "write_gbps": self.write_nbytes / self.seconds / GB,
                "combined_gbps": (self.read_nbytes + self.write_nbytes) / self.seconds / GB}


def mix(handle: Handle, directory: str, nbytes: int, *, window: int = 2, passes: int = 2,
        on_progress: Progress | None = None) -> MixResult:
    """Replay the I/O of `passes` training steps on one SwapFile of `nbytes` of layer tensors.

    The steps follow `mix_schedule`. While one layer is in use, the reads of the next `window`
    layers are in flight (prefetch), and in backward the layers used before are being written
    back (optimizer) at the same time; one request per tensor. Before the timed steps, an
    untimed pass writes every tensor once. `on_progress` gets 1 per layer used.
    """
    specs, layers = plan_layers(nbytes)
    slots = window + 2  # window layers being read, one in use, one being written back
    schedule = mix_schedule(layers, passes)
    with SwapFile(os.path.join(directory, "mix.swap"), nbytes) as swap:
        extents = [[swap.allocate(spec.nbytes) for spec in specs] for _ in range(layers)]
        starts = np.cumsum([0] + [extent.capacity for extent in extents[0]]).tolist()
        buffers = [_pattern_buffer(starts[-1]) for _ in range(slots)]
        views = [[buf[start:start + spec.nbytes]
                  for start, spec in zip(starts, specs, strict=False)]
                 for buf in buffers]

        def start(op: str, layer: int, slot: int) -> list[Any]:
            """One request per tensor of `layer`, from or into buffer `slot`."""
            transfer = swap.read if op == "read" else swap.write
            return [transfer(handle, extent, view)
                    for extent, view in zip(extents[layer], views[slot], strict=True)]

        for layer in range(layers):  # untimed: every extent written once, see [Note: honest reads]
            for request in start("write", layer, 0):
                request.wait()
        drop_page_cache(swap.path)
        reads: dict[int, list[Any]] = {}
        writes: dict[int, list[Any]] = {slot: [] for slot in range(slots)}
        issued = 0
        with DevicePauses(directory) as pauses:  # [Note: a disk that pauses]
            begin = time.perf_counter()
            for use, (layer, write_back) in enumerate(schedule):
                while issued < min(len(schedule), use + window + 1):  # prefetch into a free slot
                    for request in writes[issued % slots]:
                        request.wait()
                    reads[issued] = start("read", schedule[issued][0], issued % slots)
                    issued += 1
                for request in reads.pop(use):  # the layer in use must be here
                    request.wait()
                if write_back:
                    writes[use % slots] = start("write", layer, use % slots)
                if on_progress:
                    on_progress(1)
            handle.wait_all()
            seconds = time.perf_counter() - begin
    layer_nbytes = sum(spec.nbytes for spec in specs)
    tensors = [{"name": s.name, "shape": list(s.shape),
                "dtype": str(s.dtype).removeprefix("torch."), "nbytes": s.nbytes}
               for s in specs]
    written = sum(write_back for _, write_back in schedule)
    return MixResult(handle.backend, layers, layer_nbytes, tensors, window, passes,
                     len(schedule) * layer_nbytes, written * layer_nbytes, seconds, pauses.result)


def window_stream(handle: Handle, swap: SwapFile, extents: list[Extent], nbytes: int,
               window: int, modify: bool) -> float:
    """Read every extent with `window` reads ahead and, if `modify`, write each back while the
    next ones are read: the access pattern of a prefetcher and an optimizer, on raw aio. GB/s.

    The reference that store-level benchmarks compare against (tools/bench_store.py)."""
    buffers = [aligned_empty(nbytes) for _ in range(window + 2)]
    reads: dict[int, Request] = {}
    writes: dict[int, Request] = {}
    start = time.perf_counter()
    for i in range(len(extents)):
        for j in range(i, min(i + window + 1, len(extents))):
            if j not in reads:
                slot = j % len(buffers)
                if slot in writes:  # the buffer is still being written back
                    writes.pop(slot).wait()
                reads[j] = swap.read(handle, extents[j], buffers[slot])
        reads.pop(i).wait()
        if modify:
            buf = buffers[i % len(buffers)]
            buf[:8].add_(1)
            writes[i % len(buffers)] = swap.write(handle, extents[i], buf)
    handle.wait_all()
    moved = len(extents) * nbytes * (2 if modify else 1)
    return moved / (time.perf_counter() - start) / GB


# -- fio, the physical reference -----------------------------------------------------------------


def find_fio() -> str | None:
    return shutil.which("fio")


def run_fio(fio: str, path: str, op: str, nbytes: int, config: EngineConfig, ioengine: str, *,
            requests: int | None = None, timeout_s: float = 600) -> Throughput:
    """fio on `path` with the same request size, iodepth and jobs as `config`, O_DIRECT.

    op "read"/"write": sequential over the first `nbytes`, split among the jobs like the engine
    splits them among queues. op "randread": `requests` reads of config.block_size at random
    offsets of the first `nbytes` (repeats allowed).
    """
    jobs = config.threads
    cmd = [fio, "--name=infinity-nvme-bench", f"--filename={path}", f"--rw={op}",
           f"--bs={config.block_size}", f"--iodepth={config.queue_depth}", f"--numjobs={jobs}",
           f"--ioengine={ioengine}", "--direct=1", "--group_reporting", "--lat_percentiles=1",
           "--output-format=json"]
    if op == "randread":
        if not requests:
            raise ValueError("randread needs the number of requests")
        per_job = max(1, requests // jobs) * config.block_size
        cmd += [f"--size={nbytes}", "--norandommap", f"--io_size={per_job}"]
    else:
        per_job = nbytes // jobs // config.block_size * config.block_size
        cmd += [f"--size={per_job}", f"--offset_increment={per_job}"]
    logger.debug("running %s", " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"fio failed ({done.returncode}): "
                           f"{done.stderr.strip() or done.stdout.strip()}"
                           f"\ncommand: {' '.join(cmd)}")
    job = json.loads(done.stdout[done.stdout.index("{"):])["jobs"][0]
    side = job["read" if op != "write" else "write"]
    pct = side["lat_ns"].get("percentile", {})
    seconds = side["io_bytes"] / side["bw_bytes"] if side["bw_bytes"] else 0.0
    cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["job_runtime"] / 1e3
    return Throughput(f"fio/{ioengine}", op, side["io_bytes"], seconds, side["total_ios"],
                      config.block_size, pct.get("50.000000", 0) / 1e9,
                      pct.get("99.000000", 0) / 1e9, cpu)
