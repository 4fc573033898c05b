"""DevicePauses ([Note: a disk that pauses] in aio/device_pauses.py): bins in which the
device was busy yet moved almost nothing are pauses, consecutive ones one pause; the sampler
reports over the span of its block, or nothing where the device has no counters."""

import os
import time

from aio import device_pauses
from aio.device_pauses import DevicePauses, Sample, find_pauses

MB = 1_000_000


def _samples(bins):
    """Cumulative samples 0.1 s apart from (MB moved, busy ms) per bin."""
    out, nbytes, busy = [Sample(0.0, 0, 0, 0)], 0, 0
    for i, (moved, busy_ms) in enumerate(bins, start=1):
        nbytes, busy = nbytes + moved * MB, busy + busy_ms
        out.append(Sample(0.1 * i, i, nbytes, busy))
    return out


def test_busy_bins_that_move_almost_nothing_are_pauses_and_consecutive_ones_one():
    bins = [(300, 100), (0, 100), (5, 95), (300, 100),  # one pause of two bins
            (0, 20),  # idle: nothing in flight most of the bin, not a pause
            (11, 100),  # busy, 110 MB/s: under the floor, a pause
            (13, 100)]  # busy, 130 MB/s: moving, not a pause
    found = find_pauses(_samples(bins))
    assert found.count == 2
    assert abs(found.seconds - 0.3) < 1e-9
    assert abs(found.sampled_s - 0.7) < 1e-9
    assert find_pauses(_samples([(500, 100)] * 5)).count == 0
    assert find_pauses([]).seconds == 0.0


def test_the_sampler_covers_its_block_or_says_nothing_without_counters(tmp_path):
    with DevicePauses(str(tmp_path)) as pauses:
        with open(tmp_path / "f", "wb") as f:
            f.write(os.urandom(1 << 20))
        time.sleep(0.35)
    if device_pauses.stat_path(str(tmp_path)) is None:  # e.g. tmpfs: no block device
        assert pauses.result is None
    else:
        assert pauses.result is not None
        assert 0.3 <= pauses.result.sampled_s < 5
        assert 0 <= pauses.result.seconds <= pauses.result.sampled_s
    with DevicePauses(None) as nothing:  # no NVMe tier: nothing to sample
        pass
    assert nothing.result is None
    shm = "/dev/shm"
    if os.path.isdir(shm) and device_pauses.stat_path(shm) is None:
        with DevicePauses(shm) as none:
            pass
        assert none.result is None


def test_a_counter_that_cannot_be_read_gives_no_figure_and_no_error(tmp_path, monkeypatch):
    """The figure is beside the work (a training step): a stat file that vanishes or reads
    garbage mid-way leaves `result` None, and a directory gone has no device."""
    if device_pauses.stat_path(str(tmp_path)) is None:
        assert device_pauses.stat_path(str(tmp_path / "gone")) is None
        return
    reads = []
    real = device_pauses.read_sample

    def flaky(path):
        reads.append(path)
        if len(reads) > 2:
            raise OSError(5, "Input/output error", path)
        return real(path)

    monkeypatch.setattr(device_pauses, "read_sample", flaky)
    with DevicePauses(str(tmp_path)) as pauses:
        time.sleep(0.35)
    assert pauses.result is None and len(reads) == 3  # no read after the one that failed
    monkeypatch.setattr(device_pauses, "read_sample", lambda path: int("not a counter"))
    with DevicePauses(str(tmp_path)) as garbage:
        pass
    assert garbage.result is None
    assert device_pauses.stat_path(str(tmp_path / "gone")) is None
