"""Saving a checkpoint in the background while training goes on, within a host memory budget.

    saver = AsyncCheckpointWriter(run_dir, "step200", budget_nbytes=1 << 30)
    for name, tensor in state:          # returns once the tensor is copied (bounded by the budget)
        saver.add(name, tensor)
    done = saver.commit()               # returns at once: a Future of the committed path
    ... train ...
    done.result()                       # before the next save, or at close

`add` snapshots the tensor (a host copy, in pieces of at most the budget), so the caller may
change it right after; it blocks while `budget_nbytes` of copies wait to be written. A worker
thread (one per save) feeds them to a CheckpointWriter, so the crash guarantees are its own.
An error on the worker is raised by the next `add` / `commit` and by the Future; the half
written tag is then removed.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from infinity.checkpoint.writer import DEFAULT_CHUNK_NBYTES, CheckpointWriter
from infinity.errors import CheckpointError

logger = logging.getLogger(__name__)

_COMMIT = object()  # queue marker: everything is queued, commit
_ABORT = object()  # queue marker: drop the save


class AsyncCheckpointWriter:
    """A CheckpointWriter driven from a worker thread; see the module docstring.

    `budget_nbytes` bounds the host copies waiting to be written (plus the writer's one chunk);
    the other parameters are CheckpointWriter's. Attributes: `peak_queued_nbytes`, the most
    bytes of copies that waited at once (at most `budget_nbytes`).
    """

    def __init__(self, directory: str | Path, tag: str, *, budget_nbytes: int,
                 metadata: dict[str, Any] | None = None, chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
                 update_latest: bool = True) -> None:
        if budget_nbytes <= 0:
            raise CheckpointError(f"budget_nbytes must be positive, got {budget_nbytes}")
        self._writer = CheckpointWriter(directory, tag, metadata=metadata,
                                        chunk_nbytes=chunk_nbytes, update_latest=update_latest)
        self.metadata = self._writer.metadata  # change it until commit()
        self._budget = budget_nbytes
        self._queued = 0
        self.peak_queued_nbytes = 0
        self._room = threading.Condition()
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._done: Future[Path] = Future()
        self._error: BaseException | None = None
        self._finished = False
        self._thread = threading.Thread(target=self._drain, name=f"infinity-save-{tag}",
                                        daemon=True)
        self._thread.start()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue a snapshot of `tensor` as `name`; blocks while the budget is full."""
        self._check_open()
        flat = tensor.detach().reshape(-1)
        step = max(1, self._budget // max(1, tensor.element_size()))
        self._ops.put(("open", name, tuple(tensor.shape), tensor.dtype))
        for start in range(0, flat.numel(), step):
            piece = flat[start:start + step]
            self._reserve(piece.numel() * piece.element_size())
            self._ops.put(("write", piece.to("cpu", copy=True)))
        self._ops.put(("close",))

    def commit(self) -> Future[Path]:
        """Queue the commit; the Future gives the tag's path once it is durable."""
        self._check_open()
        self._finished = True
        self._ops.put(_COMMIT)
        return self._done

    def abort(self) -> None:
        """Drop the save (queued copies included) and wait until its files are gone."""
        if not self._finished:
            self._finished = True
            self._ops.put(_ABORT)
        self._thread.join()

    def _check_open(self) -> None:
        if self._error is not None:
            raise self._error
        if self._finished:
            raise CheckpointError(f"checkpoint {self._writer.tag!r} was already committed "
                                  "or aborted")

    def _reserve(self, nbytes: int) -> None:
        with self._room:
            while self._queued and self._queued + nbytes > self._budget and self._error is None:
                self._room.wait()
            if self._error is not None:
                raise self._error
            self._queued += nbytes
            self.peak_queued_nbytes = max(self.peak_queued_nbytes, self._queued)

    def _drain(self) -> None:
        """Worker: apply the queued operations in order; on an error keep draining (so `add`
        never blocks on a dead worker) and remove the half-written tag."""
        sink = None
        while True:
            op = self._ops.get()
            if op is _COMMIT or op is _ABORT:
                break
            if op[0] == "write":
                nbytes = op[1].numel() * op[1].element_size()
                if self._error is None:
                    self._apply(sink.write, op[1])
                with self._room:
                    self._queued -= nbytes
                    self._room.notify_all()
            elif self._error is None:
                if op[0] == "open":
                    sink = self._apply(self._writer.open_tensor, *op[1:])
                else:
                    self._apply(sink.close)
        if op is _COMMIT and self._error is None:
            path = self._apply(self._writer.commit)
            if self._error is None:
                self._done.set_result(path)
                return
        self._writer.abort()
        if self._error is not None:
            self._done.set_exception(self._error)
        else:
            self._done.cancel()

    def _apply(self, fn: Any, *args: Any) -> Any:
        """fn(*args), or None after recording its error for the caller."""
        try:
            return fn(*args)
        except BaseException as e:  # handed to the caller through add/commit and the Future
            logger.error("background checkpoint save of %r failed: %s", self._writer.tag, e)
            with self._room:
                self._error = e
                self._room.notify_all()
            return None
