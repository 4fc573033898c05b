"""Host backings use aio.aligned_empty: see [Note: physically contiguous buffers] in
aio/buffers.py."""

import torch

from aio.buffers import HUGE_PAGE_NBYTES
from infinity.memory._backing import Backing


def test_a_large_host_backing_starts_on_a_huge_page_and_is_zeroed():
    backing = Backing(3 * HUGE_PAGE_NBYTES + 4096, torch.device("cpu"), pinned=False)
    try:
        assert backing.tensor.data_ptr() % HUGE_PAGE_NBYTES == 0
        assert backing.tensor.nbytes == 3 * HUGE_PAGE_NBYTES + 4096
        assert not backing.tensor.any()
        backing.tensor[-1] = 5  # writable to the last byte
        assert int(backing.tensor.sum()) == 5
    finally:
        backing.close()


def test_small_backings_keep_the_asked_alignment():
    backing = Backing(10000, torch.device("cpu"), pinned=False, alignment=8192)
    assert backing.tensor.data_ptr() % 8192 == 0 and backing.tensor.nbytes == 10000
    assert not backing.tensor.any()
