"""aligned_empty's huge-page backing: see [Note: physically contiguous buffers] in
aio/buffers.py."""

import gc
import pathlib

import pytest
import torch

import aio
from aio import buffers

THP_MODE = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vma_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_large_buffers_start_on_a_huge_page_and_are_advised_for_huge_pages():
    buf = aio.aligned_empty(3 * buffers.HUGE_PAGE_NBYTES + 4096, pin=False)
    assert buf.data_ptr() % buffers.HUGE_PAGE_NBYTES == 0
    assert buf.nbytes == 3 * buffers.HUGE_PAGE_NBYTES + 4096 and buf.is_contiguous()
    if not THP_MODE.exists() or "[never]" in THP_MODE.read_text():
        pytest.skip("this kernel has no transparent huge pages to advise")
    vma = _vma_of(buf.data_ptr())
    assert "hg" in vma["VmFlags"].split()  # MADV_HUGEPAGE was applied to this very mapping


def test_the_buffer_outlives_every_other_reference_and_holds_data():
    tail = aio.aligned_empty(4 * buffers.HUGE_PAGE_NBYTES, pin=False)[-4096:]
    gc.collect()
    tail.fill_(7)
    assert int(tail.sum()) == 7 * 4096


def test_small_or_over_aligned_buffers_keep_the_ordinary_allocator():
    small = aio.aligned_empty(buffers.HUGE_PAGE_NBYTES - 4096, pin=False)
    assert small.data_ptr() % 4096 == 0 and small.nbytes == buffers.HUGE_PAGE_NBYTES - 4096
    over = aio.aligned_empty(buffers.HUGE_PAGE_NBYTES, 2 * buffers.HUGE_PAGE_NBYTES, pin=False)
    assert over.data_ptr() % (2 * buffers.HUGE_PAGE_NBYTES) == 0


def test_a_read_into_a_huge_page_buffer_returns_the_file(tmp_path):
    nbytes = 2 * buffers.HUGE_PAGE_NBYTES
    data = aio.aligned_empty(nbytes, pin=False)
    data.copy_(torch.arange(nbytes, dtype=torch.int64).to(torch.uint8))
    path = tmp_path / "f"
    with aio.Handle(block_size=1 << 20, queue_depth=4) as handle:
        assert handle.write(data, path).wait() == nbytes
        back = aio.aligned_empty(nbytes, pin=False)
        assert handle.read(back, path).wait() == nbytes
    assert bool((back == data).all())
