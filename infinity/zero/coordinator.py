"""ParamCoordinator: brings fetch units in before a module runs and lets them go after, along
the layer trace.

Verbs, called from the hooks (infinity.zero.hooks): `begin_pass` / `end_pass` around one
forward (+ backward), `acquire` / `release` around a module's forward, `acquire_for_backward`
when a module's outputs get their gradients, `grad_ready` when a parameter's gradient is final,
`end_backward` after `loss.backward()`. Between passes, `release_all` before anything modifies
the values in the store (the optimizer step).

[Note: prefetch along the trace] After each use at trace position i, units at positions i+1...
are fetched (taking a store use, state FETCHING) until the elements within the window exceed
`prefetch_numel` or the live elements would exceed `max_live_numel` (the next unit is always
allowed). A released unit whose next use in the trace comes within `max_reuse_numel` elements
stays READY. The store is told the distance to each unit's next use (`next_use`, the one
writer of units' next-use hints), so its eviction follows the trace. Budgets are in elements,
as DeepSpeed's stage3_* knobs are.

[Note: read ahead without waiting] Read-ahead runs on the thread that computes. The next unit
may wait for room (for a copy's write-back to land, or another thread's release): its read must
start now. A unit past it may not (`store.fetch(wait=False)`): where its room would wait, the
read-ahead stops there and goes on after the next use, when that I/O has likely landed; the
units kept for reuse stay. Measured on the 294M GPT with the state on NVMe (docs/performance.md,
"Read ahead that does not wait"): the compute thread had waited about 0.25 s a step for
optimizer tiles' write-backs to make room for values read far ahead.

[Note: callbacks outside the lock] The engine's callbacks run without the coordinator's lock:
`on_grads_final` may run a collective and hand the unit to the optimizer's worker, and
`ready(unit, True)` may wait for the worker or step the unit itself, while the worker, or
another thread, may need the coordinator. A use waits for its units to be ready before it takes
the lock (`_wait_ready`); under the lock `ready` is only asked, never waited on.

[Note: gathers in step on every rank] With the parameters partitioned over ranks, each unit
becomes READY through one all-gather, which every rank must issue in the same order. Whether a
unit is still READY when used again must therefore not depend on anything rank-local: keeping
a unit for reuse depends on store pressure and on how many prefetches landed, so with a
`gather` no unit is kept (released units are fetched again, from the shard the store keeps).
Prefetch reads only the local shard (as far as the store has room: rank-local). The all-gather
of the unit the trace uses next is started when a module acquires its units (its shard read
first, if the prefetch did not), so it runs while that module computes; that depends only on
the trace and on which units are READY, the same on every rank. A unit with a gather in flight
is not dropped to make room (that would be rank-local); released otherwise, it waits for the
gather and discards it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from infinity.errors import BudgetError, WouldWait
from infinity.store import TensorStore, Tier
from infinity.zero._common import PrefetchStats, UnitState
from infinity.zero.next_use import NextUseClock
from infinity.zero.ranks import PendingGather, Ranks
from infinity.zero.saved_views import SavedView, ViewIndex, pack_saved, unpack_saved
from infinity.zero.trace import PassCursor, Trace, TraceBook
from infinity.zero.unit import FetchUnit
from infinity.zero.upcasts import UpcastBuffers

logger = logging.getLogger(__name__)


class ParamCoordinator:
    """Fetches, keeps and releases fetch units; records traces and prefetches along them.

    Args:
        units: every unit of the model (from `build_units`); persistent ones stay fetched
            from their first use until `release_all`.
        store: the store holding the units' values.
        fetch_tier: where modules compute from (Tier.DEVICE with an accelerator, else Tier.HOST).
        device: the compute device (placeholders are made there).
        prefetch_numel, max_live_numel, max_reuse_numel: see [Note: prefetch along the trace].
        max_traces: traces memoised per pass key.
        on_grads_final: called when a unit's gradient buffer holds this backward's final
            gradients, after the unit was released (the lock not held: [Note: callbacks
            outside the lock]).
        gather: with several ranks at stage 3, the store holds this rank's shard of each unit:
            a fetched shard is all-gathered into the whole unit before it is bound, and units
            are not kept for reuse (see [Note: gathers in step on every rank]).
        ready: asked before a unit's values are fetched, `ready(unit, wait)`: whether they may
            be now (the engine's optimizer may still be updating them); with wait=True it
            returns once they may (called without the lock). Prefetch stops at a unit not ready.

    Thread-safe (autograd may run hooks from its own threads).
    """

    def __init__(self, units: Sequence[FetchUnit], store: TensorStore, *, fetch_tier: Tier,
                 device: torch.device, prefetch_numel: int, max_live_numel: int,
                 max_reuse_numel: int, max_traces: int = 4,
                 on_grads_final: Callable[[FetchUnit], None] | None = None,
                 gather: Ranks | None = None,
                 ready: Callable[[FetchUnit, bool], bool] | None = None) -> None:
        self.units = list(units)
        self.gather = gather
        self.on_grads_final = on_grads_final
        self.ready = ready
        self.store = store
        self.fetch_tier = fetch_tier
        self.prefetch_numel = int(prefetch_numel)
        self.max_live_numel = int(max_live_numel)
        self.max_reuse_numel = int(max_reuse_numel)
        self.stats = PrefetchStats()
        self.next_use = NextUseClock(store, next_pass=self._fetches_until_next_pass)
        self._positions = {u.key: i for i, u in enumerate(self.units)}  # as traces name them
        # the store's clock at the latest pass's start, and fetches from the one before to it
        self._pass_start: int | None = None
        self._pass_span: int | None = None
        self._ended_trace: Trace | None = None  # the trace of the latest pass that ended
        self._placeholders = {u.compute_dtype: torch.empty(0, dtype=u.compute_dtype, device=device)
                              for u in self.units}
        self._book = TraceBook([u.numel for u in self.units], max_traces)
        self._cursor: PassCursor | None = None
        self._live_numel = 0  # elements of non-persistent units FETCHING or READY
        self._views = ViewIndex()  # READY units by address; see [Note: saved parameter views]
        # wider copies of units used again; the plan sets two of the largest aside for them
        self.upcasts = UpcastBuffers(2 * max((u.compute_nbytes for u in self.units
                                              if _upcast(u)), default=0))
        self._resident = [u for u in self.units if u.persistent]
        self._resident_ready = False
        # see [Note: gathers in step on every rank]
        self._gathers: dict[FetchUnit, PendingGather] = {}
        self._not_ready: set[FetchUnit] = set()  # prefetch stopped at them: `ready` said no
        self.in_backward = False  # between the first backward acquire of a pass and its end
        self._lock = threading.RLock()

    # -- passes --------------------------------------------------------------------------------

    def begin_pass(self, key: Hashable) -> None:
        """Start a pass (ending one still open) and prefetch the head of its memoised trace."""
        self._wait_ready(self._resident)
        with self._lock:
            if self._cursor is not None:
                self.end_pass()
            now = self.store.clock
            if self._pass_start is not None:
                self._pass_span = now - self._pass_start
            self._pass_start = now
            self._cursor = self._book.start(key)
            if self._cursor.started_on_trace:
                self.stats.trace_switches += 1
            self._fetch_resident()
            self._prefetch_after(-1)

    def abort_pass(self) -> None:
        """The forward failed: forget the pass (no trace is memoised) and release every
        non-persistent unit, whatever module calls were left unfinished."""
        with self._lock:
            self._cursor = None
            self.in_backward = False
            for u in self.units:
                u.users, u.held_for_backward, u.grads_seen = 0, False, 0
                if not u.persistent and u.state is not UnitState.RELEASED:
                    self._release_unit(u)

    def end_pass(self) -> None:
        """Memoise the pass's trace and release every unit no module is using."""
        with self._lock:
            if self._cursor is None:
                return
            self._ended_trace = self._book.finish(self._cursor)
            self._cursor = None
            self.in_backward = False
            for u in self.units:
                if not u.persistent and u.users == 0 and u.state is not UnitState.RELEASED:
                    self._release_unit(u)

    def traces(self, key: Hashable) -> int:
        """How many traces are memoised for pass `key`."""
        return self._book.count(key)

    # -- uses ----------------------------------------------------------------------------------

    def acquire(self, units: Sequence[FetchUnit]) -> None:
        """A module is about to run: its units' parameters hold their values on return."""
        self._wait_ready([*self._resident, *units])
        with self._lock:
            self._acquire(units)

    def release(self, units: Sequence[FetchUnit]) -> None:
        """A module finished: units no module uses any more are released (or kept for reuse)."""
        with self._lock:
            for u in units:
                if u.users <= 0:
                    raise RuntimeError(f"unit {u.name!r} released more often than acquired")
                u.users -= 1
                if u.users == 0 and not u.persistent and not self._reused_soon(u):
                    self._release_unit(u)

    def acquire_for_backward(self, units: Sequence[FetchUnit]) -> None:
        """A module's backward is about to run: hold its units until their gradients are final."""
        self._wait_ready([*self._resident, *units])
        with self._lock:
            self.in_backward = True
            todo = [u for u in units if not u.held_for_backward]
            self._acquire(todo)
            for u in todo:
                u.held_for_backward = True

    def grad_ready(self, unit: FetchUnit) -> None:
        """One parameter's gradient is final; when all of the unit's are, move them to the unit's
        gradient buffer and let the unit go."""
        with self._lock:
            unit.grads_seen += 1
            final = unit.grads_seen == len(unit.slots)
            if final:
                self._finish_grads(unit)
        if final:
            self._grads_final(unit)

    def frozen_backward_done(self, units: Sequence[FetchUnit]) -> None:
        """A module's backward finished (its inputs' gradients exist): let its frozen units go;
        no gradient of theirs would say so, and held to end_backward they would pile up."""
        with self._lock:
            for u in units:
                if u.held_for_backward and not u.requires_grad:
                    u.held_for_backward = False
                    self.release([u])

    def end_backward(self) -> None:
        """After loss.backward(): collect gradients of units some of whose parameters got none,
        release what backward still held and end the pass."""
        with self._lock:
            finished = [u for u in self.units if u.grads_seen]
            for u in self.units:
                if u.grads_seen:
                    self._finish_grads(u)
                elif u.held_for_backward:
                    u.held_for_backward = False
                    self.release([u])
        for u in finished:
            self._grads_final(u)
        with self._lock:
            self.end_pass()

    def release_all(self) -> None:
        """End the pass and release every unit, persistent ones included (before the values in
        the store change). Raises if a module is still using one."""
        with self._lock:
            self.end_pass()
            for u in self.units:
                if u.users:
                    raise RuntimeError(f"unit {u.name!r} is still used by {u.users} module call(s)")
                if u.state is not UnitState.RELEASED:
                    self._release_unit(u)
            self._resident_ready = False

    def pack(self, t: torch.Tensor) -> Any:
        """Autograd pack hook: see [Note: saved parameter views]."""
        with self._lock:
            return pack_saved(self._views, t)

    def unpack(self, saved: Any) -> torch.Tensor:
        """Autograd unpack hook: see [Note: saved parameter views]."""
        if isinstance(saved, SavedView):
            self._wait_ready([saved.unit])
        with self._lock:
            return unpack_saved(self, saved)

    # -- callbacks (lock not held): see [Note: callbacks outside the lock] ----------------------

    def _grads_final(self, unit: FetchUnit) -> None:
        if self.on_grads_final is not None:
            self.on_grads_final(unit)

    def _wait_ready(self, units: Sequence[FetchUnit]) -> None:
        """Return once the engine lets these units' values be fetched (waiting for the
        optimizer to finish updating them); a use that waited counts as `after_optimizer`."""
        if self.ready is None:
            return
        for u in units:
            if u.state is not UnitState.RELEASED or self.ready(u, False):
                continue
            with self._lock:
                self._not_ready.add(u)
                # kept for reuse: the optimizer updating u may need the room
                self._drop_unused(UnitState.READY)
            try:
                self.ready(u, True)  # (stepping u here if the worker failed)
            except BudgetError:
                with self._lock:
                    self._drop_unused()
                self.ready(u, True)

    # -- internals (lock held) -------------------------------------------------------------------

    def _acquire(self, units: Sequence[FetchUnit]) -> None:
        self._fetch_resident()
        for u in units:
            self._use(u)
            u.users += 1
        if self.gather is not None:
            self._gather_next()

    def _finish_grads(self, unit: FetchUnit) -> None:
        """Take the unit's gradients and let it go; the caller calls `_grads_final` once the
        lock is released."""
        self._with_room(unit.take_grads)  # a gradient in the store may need the read-ahead's room
        unit.grads_seen = 0
        if unit.held_for_backward:
            unit.held_for_backward = False
            self.release([unit])

    def _fetch_resident(self) -> None:
        if self._resident_ready:
            return
        for u in self._resident:
            if u.state is UnitState.RELEASED:
                self._start(u, next_use=0, make_room=True)
                self._wait(u)
        self._resident_ready = True

    def _use(self, u: FetchUnit) -> None:
        """Record the use in the trace, make the unit READY, then prefetch what follows."""
        self.stats.acquires += 1
        pos = -1
        if self._cursor is not None:
            if self._cursor.observe(u.index):
                self.stats.divergences += 1
                logger.debug("zero: pass left its trace at use %d (unit %r); on demand from here",
                             self._cursor.pos, u.name)
                self._drop_prefetched()
            pos = u.last_pos = self._cursor.pos
        if u.state is UnitState.READY:
            self.stats.kept += 1
        elif u.state is UnitState.FETCHING:
            self.stats.prefetch_hits += 1
        else:
            if u in self._not_ready or (self.ready is not None and not self.ready(u, False)):
                self.stats.after_optimizer += 1  # not prefetched: its values were changing
            else:
                self.stats.on_demand += 1
                if self.store.tiers_of(u.key) == [Tier.NVME.label]:
                    self.stats.on_demand_nvme += 1
            self._start(u, next_use=0, make_room=True)
        if u.state is UnitState.FETCHING:
            self._wait(u)
        self._prefetch_after(pos)

    def _start(self, u: FetchUnit, *, next_use: float, make_room: bool,
               wait: bool = True) -> None:
        u.expect(UnitState.RELEASED)
        self._not_ready.discard(u)
        if self.ready is not None and not self.ready(u, False):
            raise RuntimeError(f"unit {u.name!r} fetched while the optimizer updates it: a use "
                               f"waits for it before taking the lock (_wait_ready)")

        def fetch() -> None:  # a pass only reads values: one still being written through is
            # handed out at once (the optimizer's fetches, which write, wait for the write)
            u.future = self.store.fetch(u.key, self.fetch_tier, next_use=next_use, wait=wait,
                                        reads_only=True)
        if make_room:  # units kept for reuse or read ahead give way to one needed now
            self._with_room(fetch)
        else:
            fetch()
        u.state = UnitState.FETCHING
        if not u.persistent:
            self._live_numel += u.numel

    def _wait(self, u: FetchUnit) -> None:
        start = time.perf_counter()
        try:
            flat = u.future.result()
            if self.gather is not None:
                pending = self._gathers.pop(u, None) or self.gather.all_gather_start(
                    flat, u.numel, f"parameters {u.key}")
                flat = pending.wait()
        finally:
            self.stats.stall_s += time.perf_counter() - start
        if _upcast(u):
            flat = self.upcasts.copy(flat, u.compute_dtype)
        u.bind(flat)
        u.state = UnitState.READY
        self._views.add(u)

    def _gather_next(self) -> None:
        """Start the all-gather of the unit the trace uses next; see [Note: gathers in step on
        every rank]."""
        trace = self._cursor.trace if self._cursor is not None else None
        if trace is None or self._cursor.pos + 1 >= len(trace):
            return
        v = self.units[trace.units[self._cursor.pos + 1]]
        if v.persistent or v.state is UnitState.READY or v in self._gathers:
            return
        if v.state is UnitState.RELEASED:
            self._start(v, next_use=1.0, make_room=True)
        self._gathers[v] = self.gather.all_gather_start(v.future.result(), v.numel,
                                                        f"parameters {v.key}")
        self.stats.gathered_ahead += 1

    def _release_unit(self, u: FetchUnit) -> None:
        u.expect(UnitState.FETCHING, UnitState.READY)
        pending = self._gathers.pop(u, None)
        if pending is not None:  # every rank started it: finish it before the shard goes
            pending.wait()
        if u.state is UnitState.READY:
            self._views.remove(u)
            copy = u.flat
            u.unbind(self._placeholders[u.compute_dtype])
            if _upcast(u):
                self.upcasts.give_back(copy)
        u.future = None
        u.state = UnitState.RELEASED
        if not u.persistent:
            self._live_numel -= u.numel
        self.store.release(u.key, self.fetch_tier)
        self.next_use.released(u.key, self._uses_until_next(u))

    def _uses_until_next(self, u: FetchUnit) -> int | None:
        """Uses of the trace from now to u's next one (None: the trace does not use it again)."""
        trace = self._cursor.trace if self._cursor is not None else None
        if trace is None or not 0 <= u.last_pos < len(trace):
            return None
        nxt = trace.next_pos[u.last_pos]
        return nxt - self._cursor.pos if nxt < len(trace) else None

    def _fetches_until_next_pass(self, key: str) -> int | None:
        """Store fetches from now until the next pass, as long as the latest one and following
        its trace, first uses unit `key` (None: no trace or span yet, or the trace does not
        use the unit). Called from the optimizer's worker without the lock: a pass starting or
        ending meanwhile only makes the hint stale."""
        cursor, start, span = self._cursor, self._pass_start, self._pass_span
        trace = cursor.trace if cursor is not None else self._ended_trace
        if trace is None or start is None or span is None:
            return None
        first = trace.first_pos.get(self._positions[key])
        if first is None:
            return None
        return max(0, start + span + first - self.store.clock)

    def _reused_soon(self, u: FetchUnit) -> bool:
        if self.gather is not None:  # See [Note: gathers in step on every rank]
            return False
        trace = self._cursor.trace if self._cursor is not None else None
        if (trace is None or not 0 <= u.last_pos < len(trace)
                or self._live_numel > self.max_live_numel):
            return False
        nxt = trace.next_pos[u.last_pos]
        return nxt < len(trace) and trace.numel_between(u.last_pos + 1, nxt) <= self.max_reuse_numel

    def _prefetch_after(self, pos: int) -> None:
        """Prefetch along every trace the pass may still follow (a route not taken yet costs
        reads, a route missed costs a stall)."""
        if self._cursor is None or self.prefetch_numel <= 0:
            return
        for trace in self._cursor.candidates:
            self._prefetch_along(trace, pos)

    def _prefetch_along(self, trace: Trace, pos: int) -> None:
        for j in range(pos + 1, len(trace)):
            first = j == pos + 1
            if not first and trace.numel_between(pos + 1, j + 1) > self.prefetch_numel:
                return
            u = self.units[trace.units[j]]
            if u.state is not UnitState.RELEASED:
                continue
            if not first and self._live_numel + u.numel > self.max_live_numel:
                return
            if self.ready is not None and not self.ready(u, False):
                self._not_ready.add(u)
                return  # its values are still being updated (and what follows, most likely)
            # [Note: read ahead without waiting]
            try:
                self._start(u, next_use=float(j - pos), make_room=False, wait=first)
            except WouldWait:
                return
            except BudgetError:
                if not self._drop_kept_after(trace, pos, j):
                    return  # the tier is full of units in use: the rest is fetched when needed
                try:
                    self._start(u, next_use=float(j - pos), make_room=False, wait=first)
                except BudgetError:
                    return

    def _drop_kept_after(self, trace: Trace, pos: int, j: int) -> bool:
        """Release the units kept for reuse whose next use in `trace` comes after position `j`
        (a unit needed sooner is being read ahead), so the store can evict them, farthest first
        by their next-use hints; the unit used at `pos` (now) stays. True if any was released."""
        dropped = False
        for u in self.units:
            if u.persistent or u.users or u.state is not UnitState.READY or u.last_pos == pos \
                    or not 0 <= u.last_pos < len(trace):
                continue
            if trace.next_pos[u.last_pos] > j:
                self._release_unit(u)
                dropped = True
        return dropped

    def _drop_prefetched(self) -> None:
        for u in self.units:
            if u.state is UnitState.FETCHING and u.users == 0:
                self._release_unit(u)

    def _with_room(self, call: Callable[[], Any]) -> None:
        """call(); if the host tier had no room, release the units no module uses (kept for
        reuse, read ahead) and call again."""
        try:
            call()
        except BudgetError:
            self._drop_unused()
            call()

    def _drop_unused(self, *states: UnitState) -> None:
        """Release the units no module uses (those in `states` if given)."""
        for u in self.units:
            if not u.persistent and u.users == 0 and u.state is not UnitState.RELEASED \
                    and u not in self._gathers and (not states or u.state in states):
                self._release_unit(u)


def _upcast(u: FetchUnit) -> bool:
    """Whether u is used through a wider copy that comes and goes with its uses (resident units
    keep theirs until the optimizer step)."""
    return u.widened and not u.persistent
