"""A state dict in `torch.save`'s zip format, written one tensor at a time: `torch.load` reads
it as it reads a `torch.save` file (weights_only included), but the whole dict never exists.

torch.save pickles the dict first (each storage pickled as a reference: type, key, numel) and
writes each storage's bytes as its own zip record after the pickle. The pickle needs only names,
shapes and dtypes, so it is written from those; the records follow as the values arrive.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import torch
from torch.serialization import _get_storage_alignment, _open_zipfile_writer

_PROTOCOL = 2  # torch.save's default


class _StorageRef:
    """A storage the pickle refers to by key; its bytes are written later."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRef:
    """Pickles as the contiguous tensor torch.save would write for (storage, shape)."""

    def __init__(self, storage: _StorageRef, shape: torch.Size) -> None:
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol: int) -> tuple:
        stride = torch.empty(self.shape, device="meta").stride()
        return (
            torch._utils._rebuild_tensor_v2,
            (self.storage, 0, tuple(self.shape), stride, False, OrderedDict()),
        )


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: object) -> tuple | None:
        if isinstance(obj, _StorageRef):
            storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.dtype])
            return "storage", storage_type, obj.key, "cpu", obj.numel
        return None


def save_streamed(
    path: str | os.PathLike[str],
    specs: Sequence[tuple[str, torch.Size, torch.dtype]],
    aliases: dict[str, list[str]],
    values: Iterator[tuple[str, torch.Tensor]],
) -> None:
    """Write the state dict `{name: tensor}` of `specs` (name, shape, dtype; each name also saved
    under its `aliases`, sharing the storage, as tied weights are) to `path`, with `values`
    giving (name, tensor) in the order of `specs`, one at a time."""
    storages = {
        name: _StorageRef(str(i), dtype, shape.numel())
        for i, (name, shape, dtype) in enumerate(specs)
    }
    state: dict[str, _TensorRef] = {}
    for name, shape, _ in specs:
        for key in [name, *aliases.get(name, [])]:
            state[key] = _TensorRef(storages[name], shape)
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=_PROTOCOL).dump(state)
    with _open_zipfile_writer(os.fspath(path)) as archive:
        data = buffer.getvalue()
        archive.write_record("data.pkl", data, len(data))
        archive.write_record(".format_version", "1", 1)
        alignment = str(_get_storage_alignment())
        archive.write_record(".storage_alignment", alignment, len(alignment))
        archive.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for name, shape, dtype in specs:
            got, tensor = next(values)
            if (got, tensor.shape, tensor.dtype) != (name, shape, dtype):
                raise RuntimeError(
                    f"{path}: got {got!r} {tuple(tensor.shape)} {tensor.dtype} where "
                    f"{name!r} {tuple(shape)} {dtype} was planned"
                )
            tensor = tensor.detach().to("cpu").contiguous()
            if tensor.storage_offset() or tensor.untyped_storage().nbytes() != tensor.nbytes:
                tensor = tensor.clone()  # a view of a larger storage: its own bytes only
            storage = tensor.untyped_storage()
            archive.write_record(f"data/{storages[name].key}", storage, storage.nbytes())
            del tensor, storage  # released before the next tensor is made
