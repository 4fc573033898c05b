"""The optimizer step overlapped with backward.

[Note: optimizer overlapped with backward] The backward of a boundary micro-batch steps each
unit on a worker thread as soon as its gradients are final, while backward goes on with earlier
layers. The unit was released first, so nothing computes from its values while they change.
Each unit gets the same kernel call with the same gradient and grad_scale as after backward, so
the result is the same. The store is told the unit's values are needed again soon (the worker reads
them; the trace alone says "at the next forward", so they went first and were read from NVMe
again), and once stepped, where the next forward first uses them (`NextUseClock.stepped`).
Without clipping a unit's gradient is let go as soon as it is stepped, so the gradients held
at once are those of the units backward is ahead of the worker by, not the whole model's.
Resident units (held until the step) are stepped after backward. Whether the step stands is
known only when backward ends (the norm for clipping, the fp16 overflow check, a NaN in any
gradient): the units are stepped speculatively ([Note: speculate, then validate]). Each
unit's gradient sum of squares is taken as the gradient becomes final, before the worker
frees it; step() sums them in unit order (over every rank's shard), so
`last_grad_norm` is the norm the step after backward reports, to the bit. It pays where the
step waits on something other than the cores backward computes on (NVMe, an accelerator); with
CPU compute and everything in RAM the worker and backward only take turns on the same cores
(interleaved A/B on a 294M GPT: 1.11x plain PyTorch overlapped, see docs/performance.md), so
`infinity.overlap_optimizer` "auto" leaves it off there. With several
ranks, the collectives that make a unit's gradient final (all-reduce, or reduce-scatter) run in
the backward hook before the unit is handed to the worker; the worker runs only the Adam step,
never a collective. The engine's callbacks run outside the coordinator's lock ([Note:
callbacks outside the lock], infinity/zero/coordinator.py).

[Note: the step's tail in the next forward] Backward finishes units last layer first, so when it
ends the worker still has the first layers to step (with NVMe: read state, update, write back),
and those are what the next forward needs first. On one process `step()` does not wait for
them: the units not started yet are re-sorted into forward order (resident units first) and
`step()` returns; the next forward waits for each unit's step before fetching its values (the
coordinator's `ready` callback) and prefetches only units already stepped, so the forward's
reads and the tail's reads and write-backs share the disk (issue 7: the forward alone read at
~1.2 GB/s against the ~2 GB/s of reads and writes together). Each unit still gets the kernel call
it got before, with the step's learning rate (taken when backward started; the schedule moves
on at `step()` as before), so the result is the same. What needs the whole step done waits for
it: the next backward (gradients accumulate again only after every unit was stepped), and
named_parameters, checkpoints, close and `synchronize()`. A unit whose step failed on the worker
is stepped again on the waiting thread (retry-safe) and its error raised there if it fails again,
which leaves the step to be tried again (the step was validated: its gradients are finite).
With several ranks `step()` waits as before (stages 1-2 gather the values after the step).

[Note: speculate, then validate] The clip factor, the fp16 overflow check and the finiteness
of every gradient are known only when backward ends. The worker steps each unit anyway, as if
the step will stand unclipped and finite (gradient scale 1 / loss scale, the step's learning
rate), speculatively: the optimizer keeps what the step overwrote ([Note: speculative steps] in
infinity/optim/_kept.py: the store keeps the old tiles and values, on NVMe copy-on-write) and,
with clipping (a redo may need it), the unit keeps its gradient. So a NaN found part-way
changes nothing, with clipping or without. At step() (VALIDATING) the units queued but not
started are taken out of the queue (stepped once the step is decided, never speculated), the
running one is waited for, and the norm (summed from the squares, over every rank's shard),
the non-finite check and the fp16 overflow decide, on every rank alike (`OptimizerStep.validate`,
the code the step after backward runs too):
- the step stands at the scale the units were stepped with (clipping does not act, all finite,
  no overflow): commit, which drops what was kept; the rest of the units are queued (the tail);
- clipping acts: roll the speculated units back and queue every unit at the clip factor (the
  tail): the kernel calls the step after backward makes, on the same state, so bit for bit;
- a non-finite gradient (refused: NonFiniteGradientError) or an fp16 overflow (skipped, the
  scale lowered): roll every speculated unit back; nothing changed but what the step after
  backward changes (the skip count, the loss scale); `zero_grad()` and go on.
A unit whose speculative step failed (on its gradient, or an I/O error) is rolled back and
stepped again once the step is decided; a unit the store had no room to speculate (BudgetError
keeping its old state, found before anything of it is read) is too, with one warning, and so
are the units at least as large whose gradients become final after it: they are not handed to
the worker during that backward (the room only shrinks until the step is decided, and a unit
handed over has its state read ahead: at 7 B on a full disk 220 of 291 units read theirs for
nothing, 13 GB); smaller ones still are.
An error while deciding rolls every speculated unit back; a rollback that fails leaves the
step BROKEN (a checkpoint load goes on). The rollbacks are counted in
`Engine.stats()["optimizer"]`. Checkpoints see only committed steps: a save between a boundary
backward and its step() is refused, and a save after it settles the tail first.

[Note: when not to speculate] Where clipping acts at every step (a fresh model, a fine-tune
whose gradient norm stays above max_grad_norm), each speculated unit is rolled back and stepped
again: the speculated pass's state writes are wasted and compete with backward for the disk and
the cores (measured: the 294M GPT's clipped step 1.44x the unclipped one, docs/performance.md).
So a step after one where clipping acted is not speculated (`infinity.speculate` "auto"): its
units are handed to the worker only once the step is decided, like the units backward did not
hand over, and go on into the next forward (the tail). The first step where clipping does not
act is then not overlapped with backward, and speculation resumes at the next; a step skipped
or refused (NaN, fp16 overflow) leaves the prediction as it was. Results are the same bit for
bit either way (the same kernel calls on the same state); `stats()` counts the steps not
speculated. "always" speculates every step.

`OverlappedStep` owns what one such step needs besides the engine: the worker, the step's
learning rate and gradient scale, whether it speculates (and the counts of what it speculated
and rolled back), each unit's gradient sum of squares as its gradient becomes final (the global
norm's terms), the decision at step() (`decide`: commit or roll back the speculated units;
`OptimizerStep.validate` supplies the rule, shared with the step after backward), and the tail
(units still being stepped after step() returned). `UnitStepper` is
the worker: units are queued as their gradients become final and stepped one at a time, in
queue order, on one thread; each queued unit has a future, and the queue can be re-sorted while
it runs.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from infinity.errors import NonFiniteGradientError, described
from infinity.zero import FetchUnit
from infinity.zero.next_use import NextUseClock

logger = logging.getLogger(__name__)


class StepUndoError(RuntimeError):
    """Rolling a speculated step back failed: the engine's state is half-stepped (BROKEN)."""


class OverlappedStep:
    """The overlapped optimizer step of the engine's trained units (one step at a time).

    Args:
        units: the trained units; unit i is `units[i]`.
        step: `step(i, lr, grad_scale, speculative)` steps unit i at learning rate lr, on the
            worker (or, for a unit whose step failed there, on the thread that waits for it: it
            must be retry-safe); speculative: see [Note: speculative steps] in
            infinity/optim/_kept.py. Returns False where a speculative step found no room to
            keep the old state (nothing changed).
        settle: `settle(i, commit)` commits (True) or rolls back (False) unit i's speculative
            step.
        read_ahead: starts reading unit i's optimizer state without waiting (a hint).
        next_use: the units' next-use clock (infinity.zero.next_use).
    """

    def __init__(self, units: Sequence[FetchUnit],
                 step: Callable[[int, float, float, bool], bool],
                 settle: Callable[[int, bool], None], read_ahead: Callable[[int], None],
                 next_use: NextUseClock, *, always_speculate: bool = False) -> None:
        self._units, self._step, self._decide_unit = list(units), step, settle
        self._always_speculate = always_speculate
        self._clipping_acted = False  # at the last decided step ([Note: when not to speculate])
        self._next_use = next_use
        self._stepper = UnitStepper(self._run, read_ahead)
        self.lr = 0.0  # of the step being built: taken when its backward started
        self.grad_scale = 1.0  # of the step being built (speculated, then the validated one)
        self.speculating = False  # see [Note: speculate, then validate]
        self._unspeculated: set[int] = set()  # units a speculation found no room for
        self._no_room_numel = math.inf  # in this backward: hand over only smaller units
        self._warned_no_room = False
        self._squares: list[float | None] = [None] * len(self._units)
        self._tail = False  # step() returned; the units' futures are not settled yet
        self.stepped_in_backward = 0  # units handed to the worker during backward
        self.left_to_forward = 0  # units of a step not stepped yet when step() returned
        self.forward_wait_s = 0.0  # forward waiting for units of the last step's tail
        self.units_speculated = 0  # units stepped speculatively (then committed or rolled back)
        self.rollbacks = 0  # speculated steps rolled back (clipping acted, or refused/skipped)
        self.units_rolled_back = 0
        self.steps_not_speculated = 0  # clipping had acted at the step before

    # -- during backward ----------------------------------------------------------------------

    def begin(self, lr: float, *, grad_scale: float) -> None:
        """A boundary backward starts: its units are stepped speculatively at `lr` (the schedule
        moves on at step(), before the tail is done) and `grad_scale` (the scale of a step that
        stands unclipped: 1 / loss scale) until the step is validated."""
        self.lr, self.grad_scale = lr, grad_scale
        self.speculating = self._always_speculate or not self._clipping_acted
        self.steps_not_speculated += not self.speculating
        self._unspeculated = set()
        self._no_room_numel = math.inf
        self._squares = [None] * len(self._units)

    def grads_final(self, i: int, square: float, *, hand_over: bool) -> None:
        """Unit i's gradient is final, with sum of squares `square`; `hand_over`: step it on the
        worker now."""
        self._squares[i] = square
        if hand_over and self._may_speculate(i):
            # The worker reads these values again soon (not at the next forward, as the trace
            # says): keep the copy backward used in RAM.
            ahead = [self._units[k].key for k in self._stepper.queued()]
            self._next_use.read_by_optimizer([self._units[i].key], after=ahead)
            self._stepper.submit(i)
            self.stepped_in_backward += 1

    # -- at step() ------------------------------------------------------------------------------

    def end_speculation(self) -> tuple[list[int], list[int]]:
        """Backward is over and the step about to be validated: the units queued but not
        started leave the queue (stepped once the step is decided), the running one is waited
        for. Returns (the units stepped speculatively, the units whose speculative step failed:
        both to be committed or rolled back), and stops speculating."""
        self._stepper.withdraw()
        futures = self._stepper.take()
        concurrent.futures.wait(futures.values())
        self.speculating = False
        failed = [i for i, f in futures.items() if f.exception() is not None]
        stepped = [i for i, f in futures.items()
                   if f.exception() is None and i not in self._unspeculated]
        self.units_speculated += len(stepped)
        return stepped, failed

    def decide(self, square_of: Callable[[int], float],
               validate: Callable[[list[float], Callable[[], None]], float | None]
               ) -> tuple[float, list[int]] | None:
        """Backward is over: stop speculating and decide the step. `validate(squares, undo)`
        (every unit's gradient sum of squares, `square_of(i)` for those backward did not hand
        over) returns the step's gradient scale, or None for a skipped step, or raises for a
        refused one, calling `undo()` (roll the speculated units back) first. The speculated
        units are committed where that scale is the one they were stepped with, else rolled
        back (clipping acts: they are stepped again with it). Returns (the scale, the units
        committed) or None. Any other error rolls every speculated unit back and is raised;
        StepUndoError where that rollback fails too."""
        speculated, failed = self.end_speculation()

        def undo() -> None:
            self._roll_back(speculated)
            self.rollbacks += bool(speculated)
            self.units_rolled_back += len(speculated)

        try:
            self._roll_back(failed)  # stepped again, as a unit whose step failed is
            grad_scale = validate(self._all_squares(square_of), undo)
            if grad_scale is None:
                return None
            self._clipping_acted = grad_scale != self.grad_scale
            if self._clipping_acted:  # redo them with its factor
                undo()
                speculated = []
            for i in speculated:  # the scale they were stepped with: they stand
                self._decide_unit(i, True)
            return grad_scale, speculated
        except NonFiniteGradientError:
            raise  # validate rolled them back
        except BaseException:
            try:
                self._roll_back(speculated + failed)
            except BaseException as error:
                raise StepUndoError(
                    f"the step could not be undone ({described(error)}): the engine is broken, "
                    "load a checkpoint (engine.load_checkpoint) to go on") from error
            raise

    def _roll_back(self, units: list[int]) -> None:
        for i in units:
            self._decide_unit(i, False)

    def _all_squares(self, square_of: Callable[[int], float]) -> list[float]:
        """Every unit's gradient sum of squares, in unit order: those backward did not hand over
        (resident ones, units that got no gradient) taken now (`square_of(i)`)."""
        for i in range(len(self._units)):
            if self._squares[i] is None:
                self._squares[i] = square_of(i)
        return list(self._squares)

    def queue_rest(self, grad_scale: float, done: Sequence[int] = ()) -> None:
        """The step is decided: queue every unit not queued yet nor in `done` (stepped
        speculatively and committed), at `grad_scale`. The tail is open from here."""
        self.grad_scale = grad_scale
        for i in range(len(self._units)):
            if self._stepper.future(i) is None and i not in done:
                self._stepper.submit(i)
        self._tail = True

    def leave_to_forward(self, forward_order: Callable[[int], Hashable]) -> None:
        """step() returns before the tail is done: the units not started run in
        `forward_order` from now on, and their values stay in RAM for the next forward."""
        left = self._stepper.reorder(key=forward_order)
        self.left_to_forward += len(left)
        self._next_use.read_by_optimizer([self._units[i].key for i in left])

    # -- the tail -------------------------------------------------------------------------------

    @property
    def tail_open(self) -> bool:
        return self._tail

    def future(self, i: int) -> Future[None] | None:
        """Unit i's future in this step (None: not queued)."""
        return self._stepper.future(i)

    def ready(self, i: int, wait: bool) -> bool:
        """Whether unit i's values may be fetched: False while the tail still steps it; with
        `wait`, wait for that (stepping it here if it failed on the worker) and return True."""
        future = self.future(i) if self._tail else None
        if future is None:
            return True
        if not wait:
            return future.done() and future.exception() is None
        start = time.perf_counter()
        try:
            if self._settle(i, future):
                self._stepper.mark_done(i)
        finally:
            self.forward_wait_s += time.perf_counter() - start
        return True

    def settle(self) -> None:
        """Wait for every unit of the step, stepping again here those that failed on the
        worker. A unit that fails again raises its error once the worker is idle; the tail is
        closed either way (the step stays unfinished, as a failed step() leaves it)."""
        futures = self._stepper.take()
        self._tail = False
        try:
            for i in sorted(futures):  # (committed speculated units have none)
                self._settle(i, futures[i])
        except BaseException:
            concurrent.futures.wait(futures.values())
            raise

    def drain(self) -> None:
        """Wait for the worker to finish what it was given and close the tail, retrying
        nothing: the step is abandoned (a checkpoint load follows)."""
        futures = self._stepper.take()
        self._tail = False
        concurrent.futures.wait(futures.values())

    def shutdown(self) -> None:
        """Finish what is queued and stop the worker."""
        self._stepper.shutdown()

    def _settle(self, i: int, future: Future[None]) -> bool:
        """Wait for unit i's step; if it failed, step it here, raising if that fails too.
        True if it was stepped here."""
        error = future.exception()
        if error is None:
            return False
        logger.warning("optimizer step of %s on the worker failed (%s); retrying",
                       self._units[i].key, error)
        self._step(i, self.lr, self.grad_scale, False)
        return True

    def _may_speculate(self, i: int) -> bool:
        """Whether unit i is stepped speculatively now: while speculating, unless a unit as
        large found no room in this backward."""
        return self.speculating and self._units[i].numel < self._no_room_numel

    def _run(self, i: int) -> None:
        speculating = self.speculating
        if speculating and not self._may_speculate(i):  # a unit handed over before it found none
            self._unspeculated.add(i)
            return
        if not self._step(i, self.lr, self.grad_scale, speculating) and speculating:
            if not self._warned_no_room:
                self._warned_no_room = True
                logger.warning("no room in the store to keep the state a speculative step of %s "
                               "overwrites: it and the units as large after it are stepped "
                               "after backward, once the step is validated", self._units[i].key)
            self._unspeculated.add(i)
            self._no_room_numel = min(self._no_room_numel, self._units[i].numel)
            return
        if not self._tail:  # stepped during backward: next used where the next forward reaches it
            self._next_use.stepped(self._units[i].key)


class UnitStepper:
    """Steps queued units on a worker thread.

    Args:
        step: steps unit i (runs on the worker).
        read_ahead: starts reading unit i's optimizer state without waiting (a hint), called
            for the unit queued right behind the running one.
    """

    def __init__(self, step: Callable[[int], None], read_ahead: Callable[[int], None]) -> None:
        self._step, self._read_ahead = step, read_ahead
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="infinity-optim")
        self._lock = threading.Lock()
        self._waiting: list[tuple[int, Future[None]]] = []  # queued, not started, in running order
        self._running: int | None = None
        self._futures: dict[int, Future[None]] = {}

    def submit(self, i: int) -> None:
        """Queue unit i (once per step)."""
        with self._lock:
            if i in self._futures:
                raise RuntimeError(f"unit {i} queued twice in one step")
            self._futures[i] = future = Future()
            self._waiting.append((i, future))
            behind_running = self._running is not None and len(self._waiting) == 1
        if behind_running:
            self._read_ahead(i)
        self._executor.submit(self._run_next)

    def queued(self) -> list[int]:
        """Units running or queued, in the order they will be done: what a unit submitted now
        waits for."""
        with self._lock:
            return self._order()

    def reorder(self, key: Callable[[int], Hashable]) -> list[int]:
        """Units not started yet run in `key` order from now on (the new first one has its
        state read now if a unit is running). Returns the units not stepped yet, in the order
        they will be done: the running one, then the queue."""
        with self._lock:
            self._waiting.sort(key=lambda queued: key(queued[0]))
            left = self._order()
            first = self._waiting[0][0] if self._waiting and self._running is not None else None
        if first is not None:
            self._read_ahead(first)
        return left

    def future(self, i: int) -> Future[None] | None:
        """Unit i's future in this step (None: not queued)."""
        return self._futures.get(i)

    def mark_done(self, i: int) -> None:
        """Unit i was stepped elsewhere (a retry after its future failed)."""
        done: Future[None] = Future()
        done.set_result(None)
        self._futures[i] = done

    def withdraw(self) -> None:
        """Take the units not started out of the queue (and their futures: they may be queued
        again)."""
        with self._lock:
            for i, _ in self._waiting:
                del self._futures[i]
            self._waiting.clear()

    def take(self) -> dict[int, Future[None]]:
        """The step's futures; the next submit starts a new step."""
        futures, self._futures = self._futures, {}
        return futures

    def shutdown(self) -> None:
        """Finish what is queued and stop the thread."""
        self._executor.shutdown(wait=True)

    def _order(self) -> list[int]:
        return ([] if self._running is None else [self._running]) + [i for i, _ in self._waiting]

    def _run_next(self) -> None:
        with self._lock:
            if not self._waiting:  # withdrawn
                return
            i, future = self._waiting.pop(0)
            self._running = i
            following = self._waiting[0][0] if self._waiting else None
        try:
            if following is not None:  # read its state while this one computes
                self._read_ahead(following)
            self._step(i)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the unit
            future.set_exception(exc)
        else:
            future.set_result(None)
        finally:
            with self._lock:
                self._running = None
