"""aio.crc32c: RFC 3720 vectors, a pure-Python reference on odd lengths and misaligned starts,
both native implementations, the buffer types it takes and the GIL released while it runs."""

import errno
import random
import threading
import time

import numpy as np
import pytest
import torch

import aio

IMPLEMENTATIONS = ["auto", "portable", "hardware"]

# RFC 3720 section B.4 and the customary check value ("123456789").
ISCSI_READ_PDU = bytes.fromhex(
    "01c00000000000000000000000000000140000000000040000000014000000182800000000000000"
    "0200000000000000")
VECTORS = [
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    (ISCSI_READ_PDU, 0xD9963A56),
    (b"123456789", 0xE3069283),
    (b"", 0),
]


def _table() -> list[int]:
    table = []
    for n in range(256):
        for _ in range(8):
            n = (n >> 1) ^ (0x82F63B78 if n & 1 else 0)
        table.append(n)
    return table


TABLE = _table()


def reference_crc32c(data: bytes, crc: int = 0) -> int:
    """Byte-at-a-time CRC-32C, written from the definition (reflected 0x1EDC6F41)."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc = TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request) -> str:
    if request.param == "hardware" and not aio.crc32c_hardware_available():
        with pytest.raises(OSError) as info:
            aio.crc32c(b"x", implementation="hardware")
        assert info.value.errno == errno.ENOTSUP
        return "portable"  # the refusal is what this CPU can show; check the rest on the table
    return request.param


@pytest.mark.parametrize(("data", "expected"), VECTORS,
                         ids=lambda v: f"{v:#x}" if isinstance(v, int) else None)
def test_known_vectors(data, expected, implementation):
    assert reference_crc32c(data) == expected
    assert aio.crc32c(data, implementation=implementation) == expected


def test_random_lengths_and_misaligned_starts_match_the_reference(implementation):
    """Lengths around the 8-byte words and the 3 x 256 / 3 x 8192 interleaved blocks."""
    rng = random.Random(11)
    pool = np.frombuffer(rng.randbytes(3 * 8192 * 2 + 4096), dtype=np.uint8)
    lengths = [1, 7, 8, 9, 63, 255, 767, 768, 769, 3 * 256 + 8 * 5 + 3, 24_575, 24_576,
               24_577, 3 * 8192 + 3 * 256 + 13, 2 * 3 * 8192 + 1001]
    lengths += [rng.randrange(1, 50_000) | 1 for _ in range(8)]
    for nbytes in lengths:
        start = rng.randrange(1, 8) + 8 * rng.randrange(0, 64)  # never 8-byte aligned
        view = pool[start:start + nbytes]
        seed = rng.randrange(1 << 32)
        assert aio.crc32c(view, seed, implementation=implementation) == \
            reference_crc32c(view.tobytes(), seed), (nbytes, start)


def test_chaining_equals_one_pass(implementation):
    data = random.Random(3).randbytes(100_003)
    whole = aio.crc32c(data, implementation=implementation)
    for cut in (0, 1, 4096, 50_001, 100_003):
        head = aio.crc32c(data[:cut], implementation=implementation)
        assert aio.crc32c(data[cut:], head, implementation=implementation) == whole


def test_implementations_agree_on_a_large_buffer():
    data = torch.randint(0, 256, (5 << 20,), dtype=torch.uint8)
    values = {aio.crc32c(data, implementation=name) for name in ("auto", "portable")}
    if aio.crc32c_hardware_available():
        values.add(aio.crc32c(data, implementation="hardware"))
    assert len(values) == 1


def test_buffer_types_checksum_their_bytes():
    t = torch.arange(1000, dtype=torch.float32)
    expected = reference_crc32c(t.numpy().tobytes())
    assert aio.crc32c(t) == expected
    assert aio.crc32c(t.numpy()) == expected
    assert aio.crc32c(bytearray(t.numpy().tobytes())) == expected
    assert aio.crc32c(memoryview(t.numpy().tobytes())) == expected
    assert aio.crc32c(t.to(torch.bfloat16)) == reference_crc32c(
        t.to(torch.bfloat16).view(torch.int16).numpy().tobytes())


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="contiguous"):
        aio.crc32c(torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match="meta"):
        aio.crc32c(torch.zeros(4, device="meta"))
    with pytest.raises(TypeError, match="str"):
        aio.crc32c("text")
    with pytest.raises(ValueError, match="crc"):
        aio.crc32c(b"x", -1)
    with pytest.raises(ValueError, match="crc"):
        aio.crc32c(b"x", 1 << 32)
    with pytest.raises(ValueError, match="implementation"):
        aio.crc32c(b"x", implementation="sse")


def test_gil_is_released_while_checksumming():
    """Python code runs in another thread while one long portable checksum is in C."""
    data = np.zeros(96 << 20, dtype=np.uint8)
    window: list[float] = []
    ticks: list[float] = []

    def checksum() -> None:
        window.append(time.perf_counter())
        aio.crc32c(data, implementation="portable")
        window.append(time.perf_counter())

    worker = threading.Thread(target=checksum)
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
    worker.join()
    start, end = window
    # Holding the GIL, the worker could yield at most one switch interval (5 ms) after `start`.
    inside = [t for t in ticks if start + 0.02 < t < end]
    assert end - start > 0.03, "the checksum was too quick to tell"
    assert inside, "no Python code ran while the checksum was in C"
