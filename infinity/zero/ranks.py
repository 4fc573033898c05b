"""Data-parallel ranks: the process-group facts the engine needs (rank, world, shard bounds) and
the few collectives it issues, over `torch.distributed` (gloo on CPU, NCCL on GPUs).

One process is the common case: `Ranks.single()` has world 1, every shard is the whole unit
and every collective is the identity, so single-process code paths do not branch.

[Note: shards of a unit] A unit of n elements is cut into `world` shards of
ceil(n / world) elements; rank r owns [r * size, (r + 1) * size) of the unit's flat values,
clipped to n (the last ranks' shards end in padding, or are all padding when n < world).
Collectives move padded shards, so every rank sends and receives the same byte counts.

[Note: collective order] gloo and NCCL match collectives by the order each rank issues them.
The engine issues them from the thread that runs forward and backward (hooks included), at
points every rank reaches in the same order (the same model, the same trace), never from the
optimizer's worker.

A failed collective (a peer that died, or one past `timeout_s`) raises RankError naming this
rank, the collective and the ranks that did not answer a short roll call through the
rendezvous store; every later collective raises the same error at once (no second hang).
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from infinity.errors import ConfigError, RankError, described

logger = logging.getLogger(__name__)

T = TypeVar("T")

_SETTLE_S = 0.05  # the GIL left to gloo's workers before the group is destroyed at exit
_ROLL_CALL_S = 2.0  # how long a rank that saw a collective fail waits for the others to answer
# what torchrun sets (env:// rendezvous)
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_ending = False  # end_group_at_exit has registered its hook


def end_group_at_exit() -> None:
    """Destroy the default process group when the process ends normally, unless the
    application did (as torch asks every script to). torch 2.13's gloo group left to the
    interpreter's teardown aborts the process ("terminate called without an active exception")
    in many exits: 16 of 28 two-rank jobs of plain collectives, 1 of 8 with an engine, so a
    torchrun job that had finished reported a failed rank. Not after an unhandled exception
    (sys.last_value): it may have left a collective in flight, and destroying waits for it, up
    to the group's timeout. Registered once, at the first call: exit hooks the application
    registers later run before it, with the group."""
    global _ending
    if not _ending:
        atexit.register(_end_group)
        _ending = True


def _end_group() -> None:
    if getattr(sys, "last_value", None) is None and dist.is_initialized():
        # The GIL released a moment first: a gloo worker may still be dropping the last
        # collective's work, which takes the GIL, and destroying joins that worker while
        # holding it. The deadlock was seen (2 of 6 loaded runs) when the group went right
        # after an all-gather.
        time.sleep(_SETTLE_S)
        dist.destroy_process_group()


@dataclass(frozen=True, slots=True)
class Shard:
    """This rank's part of a unit's flat values; see [Note: shards of a unit]."""

    start: int  # first element owned
    stop: int  # one past the last real element owned (== start: the shard is all padding)
    numel: int  # elements of every rank's (padded) shard

    @property
    def real_numel(self) -> int:
        return self.stop - self.start

    def padded(self, whole: torch.Tensor) -> torch.Tensor:
        """This shard of the flat `whole` in a new tensor of `numel` elements, zero padded."""
        part = torch.zeros(self.numel, dtype=whole.dtype)
        part[:self.real_numel] = whole[self.start:self.stop]
        return part


@dataclass(frozen=True, slots=True)
class Partition:
    """What this rank holds of each unit under a ZeRO stage (DeepSpeed's meaning): stage 0
    everything; 1 also only its shard of the optimizer state; 2 also only its shard of the
    gradients; 3 also only its shard of the parameters in the store. With one rank nothing is
    partitioned, whatever the stage."""

    ranks: Ranks
    stage: int

    @property
    def state(self) -> bool:
        return self.ranks.world > 1 and self.stage >= 1

    @property
    def grads(self) -> bool:
        return self.ranks.world > 1 and self.stage >= 2

    @property
    def params(self) -> bool:
        return self.ranks.world > 1 and self.stage == 3


class PendingGather:
    """An all-gather in flight; `wait()` returns the whole unit (on the shard's device)."""

    def __init__(self, ranks: Ranks, work: Any, src: torch.Tensor, out: torch.Tensor, numel: int,
                 device: torch.device, collective: str) -> None:
        # src: alive until done
        self._ranks, self._work, self._src, self._out = ranks, work, src, out
        self._numel, self._device, self._collective = numel, device, collective

    def wait(self) -> torch.Tensor:
        self._ranks._run(self._collective, self._work.wait)
        self._src = None
        return self._out[:self._numel].to(self._device)


def environment_world_size() -> int:
    """Ranks of this job: the initialised process group's size, else torchrun's WORLD_SIZE,
    else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


class Ranks:
    """This process's place among the data-parallel ranks, and the collectives over them.

    Attributes:
        rank, world: this rank and the number of ranks.
    """

    def __init__(self, rank: int = 0, world: int = 1, *, store: Any = None) -> None:
        self.rank, self.world = rank, world
        self._store = store  # the rendezvous store, for the roll call after a failure
        self._failed: RankError | None = None

    @classmethod
    def single(cls) -> Ranks:
        return cls()

    @classmethod
    def from_environment(cls, *, timeout_s: float) -> Ranks:
        """The ranks of this job: an initialised process group, else one started from
        torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; gloo on CPU, NCCL
        on GPUs, collectives timing out after `timeout_s`), else one process. A group started
        here stays for the life of the process (later engines use it), as DeepSpeed's does; the
        group, started here or not, ends at the process's normal exit (`end_group_at_exit`).

        Ranks other than 0 log only warnings and errors from then on (logger "infinity",
        unless the application set its level)."""
        if dist.is_available() and dist.is_initialized():
            ranks = cls(dist.get_rank(), dist.get_world_size(), store=_default_store())
        elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
            missing = [k for k in _ENV if k not in os.environ]
            if missing:
                raise ConfigError(f"WORLD_SIZE is {os.environ['WORLD_SIZE']} but "
                                  f"{', '.join(missing)} is not set: launch with torchrun, "
                                  "or initialise torch.distributed first")
            ranks = cls._start_group(timeout_s)
        else:
            return cls.single()
        end_group_at_exit()
        if ranks.rank != 0 and logging.getLogger("infinity").level == logging.NOTSET:
            logging.getLogger("infinity").setLevel(logging.WARNING)  # rank 0 alone informs
        logger.info("ranks: %d data-parallel ranks over %s", ranks.world, dist.get_backend())
        return ranks

    @classmethod
    def _start_group(cls, timeout_s: float) -> Ranks:
        backend = "gloo"
        if torch.cuda.is_available():
            backend = "nccl"
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        try:
            dist.init_process_group(backend, init_method="env://",
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # noqa: BLE001 - the store and backends raise many kinds
            raise RankError(f"rank {rank} of {world}: init_process_group ({backend}, "
                            f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}) "
                            f"failed within {timeout_s:g} s: {described(exc)}",
                            rank=rank, collective="init_process_group") from exc
        return cls(dist.get_rank(), dist.get_world_size(), store=_default_store())

    # -- shards ----------------------------------------------------------------------------------

    def shard(self, numel: int) -> Shard:
        """This rank's shard of a unit of `numel` elements."""
        size = -(-numel // self.world)
        start = min(self.rank * size, numel)
        return Shard(start, min(start + size, numel), size)

    # -- collectives (see [Note: collective order]) ----------------------------------------------

    def all_reduce_mean_(self, t: torch.Tensor, what: str) -> None:
        """Average `t` over the ranks, in place."""
        if self.world > 1:
            self._collective(f"all_reduce({what})", t, dist.all_reduce)
            t.div_(self.world)

    def broadcast_(self, t: torch.Tensor, what: str, src: int = 0) -> None:
        """Overwrite `t` with rank `src`'s, in place."""
        if self.world > 1:
            self._collective(f"broadcast({what})", t, lambda x: dist.broadcast(x, src))

    def all_reduce_sum(self, value: float, what: str) -> float:
        """The sum of `value` over the ranks (float64)."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        self._collective(f"all_reduce({what})", t, dist.all_reduce)
        return float(t)

    def reduce_scatter_mean(self, full: torch.Tensor, what: str) -> torch.Tensor:
        """This rank's shard of the average over the ranks of `full` (1-D, world * shard
        elements, padded)."""
        if self.world == 1:
            return full
        device = self._device()
        src = full.to(device)
        out = torch.empty(full.numel() // self.world, dtype=full.dtype, device=device)
        self._run(f"reduce_scatter({what})", lambda: dist.reduce_scatter_tensor(out, src))
        return out.div_(self.world).to(full.device)

    def all_gather(self, shard: torch.Tensor, numel: int, what: str) -> torch.Tensor:
        """Every rank's `shard` (1-D, equal sizes) laid end to end, cut to `numel` elements."""
        if self.world == 1:
            return shard[:numel]
        return self.all_gather_start(shard, numel, what).wait()

    def all_gather_start(self, shard: torch.Tensor, numel: int, what: str) -> PendingGather:
        """Start `all_gather` (world > 1); `shard` must stay unchanged until `wait()`."""
        device = self._device()
        src = shard.to(device).contiguous()
        out = torch.empty(shard.numel() * self.world, dtype=shard.dtype, device=device)
        collective = f"all_gather({what})"
        work = self._run(collective, lambda: dist.all_gather_into_tensor(out, src, async_op=True))
        return PendingGather(self, work, src, out, numel, shard.device, collective)

    def all_gather_object(self, obj: T, what: str) -> list[T]:
        """Every rank's picklable `obj`, in rank order (small things: RNG states, flags)."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        self._run(f"all_gather_object({what})", lambda: dist.all_gather_object(out, obj))
        return out

    def check_same(self, text: str, what: str) -> None:
        """Raise ConfigError on every rank unless every rank passed the same `text` (a config,
        a model layout): a mismatch would otherwise pair wrong collectives or hang."""
        if self.world == 1:
            return
        digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
        mine = torch.tensor([digest], dtype=torch.int64)
        every = self.all_gather(mine, self.world, what)
        differ = [r for r in range(self.world) if every[r] != every[0]]
        if differ:
            raise ConfigError(f"{what} differs between ranks: rank(s) {differ} differ from rank 0; "
                              "start every rank with the same config and model")

    @property
    def failed(self) -> bool:
        """A collective failed: the job cannot go on (no further collective is tried)."""
        return self._failed is not None

    def _device(self) -> torch.device:
        """Where the backend's tensors must be: CUDA for NCCL, host memory for gloo."""
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- failures --------------------------------------------------------------------------------

    def _collective(self, collective: str, t: torch.Tensor,
                    call: Callable[[torch.Tensor], Any]) -> None:
        """Run an in-place collective on `t`, staged through the backend's device (NCCL needs
        CUDA tensors; gloo takes CPU ones)."""
        device = self._device()
        staged = t if t.device == device else t.to(device)
        self._run(collective, lambda: call(staged))
        if staged is not t:
            t.copy_(staged)

    def _run(self, collective: str, call: Callable[[], T]) -> T:
        if self._failed is not None:
            raise RankError(f"rank {self.rank}: {collective} not started, an earlier collective "
                            f"failed: {self._failed}", rank=self.rank, collective=collective,
                            peers=self._failed.peers)
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses of many kinds
            peers = self._silent_peers()
            named = (f"rank(s) {list(peers)} did not answer" if peers
                     else "no rank missing from the roll call")
            self._failed = RankError(
                f"rank {self.rank} of {self.world}: {collective} failed ({named}): "
                f"{described(exc)}",
                rank=self.rank, collective=collective, peers=peers)
            raise self._failed from exc

    def _silent_peers(self) -> tuple[int, ...]:
        """The ranks that do not answer a roll call in the rendezvous store within a few
        seconds (a store that is gone took rank 0, which hosts it, with it)."""
        if self._store is None:
            return ()
        try:
            self._store.set(f"infinity/alive/{self.rank}", "1")
            deadline = time.monotonic() + _ROLL_CALL_S
            while True:
                silent = tuple(r for r in range(self.world) if r != self.rank
                               and not self._store.check([f"infinity/alive/{r}"]))
                if not silent or time.monotonic() > deadline:
                    return silent
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store's host is unreachable
            return (0,) if self.rank != 0 else ()


def _default_store() -> Any:
    """The rendezvous store of a process group the application initialised (private torch API:
    None where it is missing, and the roll call is skipped)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001
        return None
