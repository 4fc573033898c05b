"""The counters of the block device under a directory (sysfs), and DevicePauses: how long it
was busy yet moved (almost) nothing while some work ran (a benchmark, a training step).

[Note: a disk that pauses] The development VM's virtio disk stops for 1-2.5 s every 4-7 s
when the bytes in play span tens of GB (a 7 B run's 41 GB swap file; an aio replay on a 36-40
GB file), with requests in flight and nothing completing, and does not on a 4-12 GB file
(docs/performance.md, "The disk's own pauses at a 7 B footprint"). A mixed rate measured on a
small file then overstates what a big run gets, by 1.7x there; the bench says how much of its
own run was such pauses, so a figure that has them can be told from one that has not, and
infinity-train records them per step (`disk_paused_s`), so a slow step whose disk stopped can be
told from one the engine made slow. The counters are the whole device's: other processes' I/O
counts too.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

# A bin is a pause when the device was busy (requests in flight) for at least this share of it
# while moving less than MIN_BYTES_PER_S: far below any disk's rate, far above a stray request.
BUSY_SHARE = 0.9
MIN_BYTES_PER_S = 120e6
INTERVAL_S = 0.1


@dataclass(frozen=True, slots=True)
class Sample:
    seconds: float  # time.perf_counter()
    requests: int  # reads and writes the device completed so far
    nbytes: int  # bytes read and written by the device so far
    busy_ms: int  # milliseconds with requests in flight so far (io_ticks)


@dataclass(frozen=True, slots=True)
class Pauses:
    count: int
    seconds: float
    sampled_s: float  # the span the samples cover


def find_pauses(samples: Sequence[Sample]) -> Pauses:
    """The runs of consecutive paused bins between samples (see BUSY_SHARE)."""
    count, paused, previous_paused = 0, 0.0, False
    for a, b in zip(samples, samples[1:]):
        span = b.seconds - a.seconds
        is_paused = span > 0 and (b.busy_ms - a.busy_ms) >= BUSY_SHARE * span * 1e3 \
            and (b.nbytes - a.nbytes) < MIN_BYTES_PER_S * span
        if is_paused:
            paused += span
            count += not previous_paused
        previous_paused = is_paused
    sampled = samples[-1].seconds - samples[0].seconds if samples else 0.0
    return Pauses(count, paused, sampled)


def stat_path(directory: str) -> str | None:
    """The sysfs stat file of the block device holding `directory` (None: no such file, e.g.
    tmpfs, or the directory is gone)."""
    try:
        dev = os.stat(directory).st_dev
    except OSError:
        return None
    path = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat"
    return path if os.path.exists(path) else None


def read_sample(path: str) -> Sample:
    """The device's counters now, from its stat file (`stat_path`)."""
    with open(path) as f:
        fields = [int(x) for x in f.read().split()]
    # sysfs block stat: reads [0], sectors read [2], writes [4], sectors written [6], io_ticks
    # [9]; sectors of 512 B
    return Sample(time.perf_counter(), fields[0] + fields[4], (fields[2] + fields[6]) * 512,
                  fields[9])


class DevicePauses:
    """Samples the device under `directory` every INTERVAL_S on a thread while in the block;
    `result` is then its Pauses (None where there is no directory, the device has no stat file,
    or a read of it failed: a figure beside the work, which never fails the work)."""

    def __init__(self, directory: str | None) -> None:
        self._path = stat_path(directory) if directory is not None else None
        self._samples: list[Sample] = []
        self._failed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.result: Pauses | None = None

    def __enter__(self) -> DevicePauses:
        if self._path is not None and self._read():
            self._thread = threading.Thread(target=self._sample, name="device-pauses",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        if self._read():
            self.result = find_pauses(self._samples)

    def _sample(self) -> None:
        while not self._stop.wait(INTERVAL_S) and self._read():
            pass

    def _read(self) -> bool:
        """Append a sample; False (and no result) once a read failed."""
        if self._failed or self._path is None:
            return False
        try:
            self._samples.append(read_sample(self._path))
        except (OSError, ValueError, IndexError):
            self._failed = True
        return not self._failed
