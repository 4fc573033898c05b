"""aio.asyncio: awaitable I/O, on the native engine or through aiofiles."""

import asyncio
import sys

import numpy as np
import pytest
import torch

import aio
import aio.asyncio as aio_asyncio


@pytest.mark.parametrize("native", [False, True])
def test_round_trip(tmp_path, native):
    async def main():
        with aio.Handle() as h:
            handle = h if native else None
            t = torch.randn(50_000)
            assert await aio_asyncio.write(tmp_path / "x", t, 4096, handle=handle) == 200_000
            out = torch.empty_like(t)
            assert await aio_asyncio.read(tmp_path / "x", out, 4096, handle=handle) == 200_000
            assert torch.equal(out, t)
            # many at once on one loop
            outs = [np.empty(1000, np.float32) for _ in range(8)]
            await asyncio.gather(*(aio_asyncio.read(tmp_path / "x", o, 4096 + 4000 * i,
                                                    handle=handle)
                                   for i, o in enumerate(outs)))
            for i, o in enumerate(outs):
                np.testing.assert_array_equal(o, t[1000 * i: 1000 * (i + 1)].numpy())

    asyncio.run(main())


@pytest.mark.parametrize("native", [False, True])
def test_errors(tmp_path, native):
    async def main():
        with aio.Handle() as h:
            handle = h if native else None
            with pytest.raises(aio.AIOError) as info:
                await aio_asyncio.read(tmp_path / "missing", torch.empty(4), handle=handle)
            assert info.value.errno == 2
            (tmp_path / "short").write_bytes(b"abc")
            with pytest.raises(aio.AIOError, match="end of file"):
                await aio_asyncio.read(tmp_path / "short", torch.empty(4), handle=handle)
            with pytest.raises(aio.AIOError):
                await aio_asyncio.write(tmp_path / "nodir" / "x", torch.empty(4), handle=handle)

    asyncio.run(main())


def test_without_aiofiles_only_the_handle_path_works(tmp_path, monkeypatch):
    """aiofiles is the `asyncio` extra: without it the fallback names the extra, the native path
    does not need it."""
    monkeypatch.setitem(sys.modules, "aiofiles", None)  # import aiofiles -> ImportError
    t = torch.arange(1024, dtype=torch.float32)

    async def main():
        with pytest.raises(ImportError, match=r"pip install 'infinity-offload\[asyncio\]'"):
            await aio_asyncio.write(tmp_path / "x", t)
        with aio.Handle() as handle:
            assert await aio_asyncio.write(tmp_path / "x", t, handle=handle) == t.nbytes
            out = torch.empty_like(t)
            assert await aio_asyncio.read(tmp_path / "x", out, handle=handle) == t.nbytes
        assert torch.equal(out, t)

    asyncio.run(main())
