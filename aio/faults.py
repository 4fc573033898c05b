"""Fault injection: make chosen pieces of I/O fail, come back short, or never complete.

Shared by the tests of every layer: pass `faults=[...]` to `aio.Handle` (or to anything that
builds one) to rehearse the unhappy paths on real files. A fault leaves the handle once its
piece has come; with none waiting, the engine's check costs a piece one atomic load (see
[Note: fault injection costs nothing when off] in csrc/aio/faults.c).
"""

from __future__ import annotations

import errno as _errno
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Fault:
    """The `nth` piece submission (0 = the first after the fault is installed) goes wrong.

    Pieces are the block_size cuts of requests; reads and writes are counted apart, or together
    with op="any".
    """

    op: Literal["read", "write", "any"] = "any"
    nth: int = 0
    kind: Literal["errno", "short", "hang"] = "errno"
    errno: int = _errno.EIO  # for kind="errno", e.g. EIO or ENOSPC
    nbytes: int = 1  # for kind="short": bytes the piece moves before coming back short

    def __post_init__(self) -> None:
        if self.op not in ("read", "write", "any"):
            raise ValueError(f"Fault.op must be 'read', 'write' or 'any', got {self.op!r}")
        if self.kind not in ("errno", "short", "hang"):
            raise ValueError(f"Fault.kind must be 'errno', 'short' or 'hang', got {self.kind!r}")
        if self.nth < 0:
            raise ValueError(f"Fault.nth must be >= 0, got {self.nth}")
        if self.kind == "errno" and not 0 < self.errno <= 4095:
            raise ValueError(f"Fault.errno must be a positive errno, got {self.errno}")
        if self.kind == "short" and self.nbytes <= 0:
            raise ValueError(f"Fault.nbytes must be > 0, got {self.nbytes}")

    @property
    def value(self) -> int:
        return {"errno": self.errno, "short": self.nbytes, "hang": 0}[self.kind]
