"""Adam whose state lives in the store (NVMe or host), streamed through in tiles, one engine fetch
unit at a time.

Each unit (a module's parameters flattened, as FSDP's FlatParameter) is cut into tiles on its
own (see [Note: tile formats] in `_tiles`), so `step_unit(u, grad)` can update unit u as soon as
its gradient is final, from a worker thread while backward goes on. A float32 unit's values
entry is its master (tiles hold exp_avg, exp_avg_sq); a bf16/fp16 unit's tiles hold the fp32
master too and the kernel writes the rounded values in the same pass.

A pass streams tiles: read tile i+1 (prefetch), update tile i with the CPU Adam kernel, write it
back (asynchronously, on release) while the next one computes, so host memory holds a few tiles
whatever the model size and a step runs at the speed of the disk. A failed pass is retried by
calling it again (see [Note: retry-safe steps] in `_tile_set`). The caller decides the step's
clip factor, loss scale and whether to skip it (the engine, over every unit's gradient); a
caller that steps a unit before it knows steps it speculatively and commits or rolls it back
later (see [Note: speculative steps] in `_kept`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from infinity.errors import BudgetError
from infinity.memory import ThreadPool
from infinity.optim._decay import DecaySpan, UnitKernels, check_spans
from infinity.optim._format import StateFormat
from infinity.optim._grads import GRAD_DTYPES, GradPieces, all_finite, check_grad_pieces
from infinity.optim._kept import KeptValues
from infinity.optim._native import check_hyperparameters, check_threads
from infinity.optim._state import load_states, unit_state
from infinity.optim._tile_set import TileSet
from infinity.optim._tiles import UnitSpec
from infinity.optim._values import UnitValues
from infinity.store import TensorStore, Tier

__all__ = ["DecaySpan", "SwappedOptimizer", "UnitSpec"]

_UNIT_INDEX_BITS = 40  # a unit's elements take this many bits of a rounding counter


class SwappedOptimizer:
    """Adam / AdamW over engine fetch units with all state in a TensorStore, stepped one unit at
    a time (`step_unit`, then `finish_step` once every unit is stepped).

    Args:
        units: what is stepped. Each unit's values are a 1-D store entry (`UnitSpec.values_key`)
            of its dtype. float32 unit: the values entry is the fp32 master, tiles hold exp_avg
            and exp_avg_sq (8 B/element). bf16/fp16 unit: tiles hold an fp32 master (started
            from the values, upcast) and the moments (12 B/element); new values are rounded into
            the values entry. A unit's values entry is fetched to the host tier whole while its
            tiles are updated: the host budget must hold it beside 3 tiles per concurrent
            `step_unit`. With `UnitSpec.offset` a unit steps elements [offset, offset + numel)
            of its values entry and leaves the rest alone: a data-parallel rank owning a slice of
            a unit whose values every rank holds whole (ZeRO stages 1 and 2). An entry stepped
            from offset 0 must hold exactly `numel` elements.
        store: a TensorStore. With state_tier NVME: an NVMe budget for the tiles and a host
            budget for at least 3 tiles (4 recommended).
        lr, betas, eps, weight_decay, adamw_mode: as in infinity.optim.CPUAdam. `lr` may be
            changed between steps (a scheduler).
        tile_numel: elements per tile (`sub_group_size`); the I/O unit of a step.
        threads: kernel threads (default: all cores).
        name: prefix of the store keys, so several optimizers can share a store.
        state_tier: home of the tiles: Tier.NVME (offload_optimizer nvme) or Tier.HOST (cpu).
        state_format: how the tiles store the state (`StateFormat`: bf16 or 8-bit moments, no
            fp32 master for 16-bit units); the default is the float32 state described above.
            Without a master a unit's 16-bit values are updated with stochastic rounding.
        seed: the stochastic rounding stream (with the step and each element's index: the
            same seed, steps and units round the same, so a resumed run is bit-identical).
    """

    def __init__(self, units: Sequence[UnitSpec], store: TensorStore, *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True, tile_numel: int = 1 << 22,
                 threads: int | None = None, name: str = "optim",
                 state_tier: Tier | str = Tier.NVME,
                 state_format: StateFormat | None = None, seed: int = 0) -> None:
        self.units = [UnitSpec(*u) for u in units]
        if not self.units:
            raise ValueError("SwappedOptimizer got no units")
        for u, spec in enumerate(self.units):
            _check_unit(u, spec, store)
        if isinstance(tile_numel, bool) or not isinstance(tile_numel, int) or tile_numel < 1:
            raise ValueError(f"tile_numel must be an int >= 1, got {tile_numel!r}")
        check_hyperparameters(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                              weight_decay=weight_decay)
        self.state_tier = Tier.of(state_tier)
        if self.state_tier == Tier.DEVICE:
            raise ValueError("state_tier must be Tier.NVME or Tier.HOST: the CPU kernel updates "
                             "host memory")
        # Kernel workers, started once: a pass makes a kernel call per tile. Units stepped from
        # several threads take turns on them (each call already uses every core).
        self._pool = ThreadPool(check_threads(threads))  # wrong values fail here, not at a step
        self.lr, self.betas, self.eps = lr, (float(betas[0]), float(betas[1])), eps
        self.weight_decay, self.adamw_mode = weight_decay, adamw_mode
        self.store, self.name, self.tile_numel = store, name, tile_numel
        self.state_format = StateFormat() if state_format is None else state_format
        if not isinstance(self.state_format, StateFormat):
            raise TypeError(f"state_format must be a StateFormat, got {state_format!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
        self.seed = seed
        self._completed = 0  # steps finished; tiles hold this step between steps
        self._decay: dict[int, list[DecaySpan]] = {}  # unit -> its own weight decays
        self._lock = threading.Lock()  # finish_step against itself
        self.tiles = TileSet(store, self.units, tile_numel, name, self.state_tier,
                             self.state_format)
        self.tiles.check_budget(tile_numel)
        self.tiles.write_initial(self._values())
        self._kept = KeptValues(store, self.units, name, self.state_tier)
        self._updated_at: dict[int, int] = {}  # tile -> the store's clock at its last update

    # -- steps ---------------------------------------------------------------------------------

    @property
    def completed_steps(self) -> int:
        """Steps finished (`finish_step()` calls)."""
        return self._completed

    @property
    def state_nbytes(self) -> int:
        """Bytes of the optimizer state in the store (every tile, in its format)."""
        return self.tiles.nbytes()

    def begin_step(self) -> int:
        """The number of the step being built (completed steps + 1); idempotent until
        `finish_step()`. Calling it is optional: `step_unit` always builds this step."""
        return self._completed + 1

    @torch.no_grad()
    def step_unit(self, u: int, grad: torch.Tensor | Sequence[torch.Tensor], *,
                  grad_scale: float = 1.0, check_finite: bool = True,
                  lr: float | None = None, speculative: bool = False) -> bool:
        """Update unit u's tiles for the step being built.

        `grad`: the unit's gradient, a 1-D contiguous CPU tensor of its numel
        (float32/bfloat16/float16), or a list of such tensors laid end to end (its parameters'
        own gradients: the kernel reads each where it lies, nothing is joined); multiplied by
        `grad_scale` (clip factor / loss scale, decided by the caller) inside the kernel.
        Non-finite gradients raise ValueError before anything is read or updated: overflow and
        skipped steps are decided by the caller over all units. The check is one pass over the
        gradient (a sum); `check_finite=False` skips it for a caller that has checked already
        (e.g. from the gradient norm it computes for clipping). `lr`: this step's learning rate
        (default `self.lr`), for a caller whose schedule moves on while units of a step are
        still being stepped. Retry-safe (see [Note: retry-safe steps] in `_tile_set`); safe for
        different units from different threads at once. `speculative`: keep what the step
        overwrites until `commit_unit(u)` or `rollback_unit(u)` (see [Note: speculative steps]
        in `_kept`). Returns False, with the unit unchanged, when the store has no room for
        that (step it again once the step is decided); True otherwise.
        """
        self._check_index(u)
        grad_scale = _check_scale("grad_scale", grad_scale)
        pieces = check_grad_pieces(f"unit {u}'s gradient", grad, self.units[u].numel)
        if check_finite and not all(all_finite(g) for g in pieces.pieces):
            raise ValueError(f"unit {u}'s gradient has non-finite values (inf/nan); check for "
                             f"overflow before stepping and skip the whole step")
        lr = self.lr if lr is None else lr
        check_hyperparameters(lr=lr, beta1=self.betas[0], beta2=self.betas[1], eps=self.eps,
                              weight_decay=self.weight_decay)
        if not speculative:
            self._stream(u, self._completed + 1, pieces, grad_scale, lr)
            return True
        try:
            self._stream(u, self._completed + 1, pieces, grad_scale, lr, speculative=True)
        except BudgetError:
            self.rollback_unit(u)
            return False
        return True

    def keep_unit(self, u: int) -> bool:
        """Have the store keep what a speculative step of unit u overwrites (its tiles' and
        values' bytes), as `step_unit(u, ..., speculative=True)` does first: a caller may call
        it before reading the unit's gradient, so a unit without room costs no reads. False,
        with nothing kept, where the store has no room (step it once the step is decided).
        Once kept, until `commit_unit(u)` or `rollback_unit(u)`."""
        self._check_index(u)
        values = self._values()
        try:
            try:
                self._keep(u, self.tiles.pending(u, self._completed + 1), values)
            finally:  # released before a rollback, as step_unit does
                values.release_all()
        except BudgetError:
            self.rollback_unit(u)
            return False
        return True

    def _keep(self, u: int, todo: list[int], values: UnitValues) -> None:
        if todo:
            self._kept.keep(u, lambda: values.get(u))
        for t in todo:
            self.tiles.keep(t)

    def commit_unit(self, u: int) -> None:
        """Unit u's speculative step stands: drop the state it kept (no I/O)."""
        self._kept.commit(u)
        self.tiles.commit(u)

    def rollback_unit(self, u: int) -> None:
        """Undo unit u's speculative step: its tiles, values and step record are as before it
        (a no-op for a unit with nothing kept)."""
        self._kept.roll_back(u)
        self.tiles.roll_back(u)

    def set_weight_decay(self, u: int, spans: Sequence[DecaySpan]) -> None:
        """Give elements [start, stop) of what unit u steps their own weight decay (a client's
        parameter groups: decay on weights, none on biases and norms); elements no span covers
        keep the optimizer's `weight_decay`. ValueError for spans that overlap or leave the
        unit, or a decay outside Adam's range."""
        self._check_index(u)
        checked = check_spans(u, spans, self.units[u].numel)
        for span in checked:
            check_hyperparameters(lr=self.lr, beta1=self.betas[0], beta2=self.betas[1],
                                  eps=self.eps, weight_decay=span.weight_decay)
        if self.state_format.quantized:  # a fused call never splits an 8-bit block
            block = self.state_format.block
            for t in self.tiles.of_unit[u]:
                tile = self.tiles[t]
                for edge in {e for span in checked for e in span[:2]}:
                    if tile.start < edge < tile.stop and (edge - tile.start) % block:
                        raise ValueError(
                            f"unit {u}: a weight decay range ends at element {edge}, inside an "
                            f"8-bit block of {block} elements; with int8 moments a unit's decay "
                            "ranges must fall on its blocks (or give every group one decay)")
        self._decay[u] = checked

    def prefetch_unit(self, u: int) -> list[str]:
        """Start reading unit u's first tile not yet at the step being built (and the values
        it updates), without holding anything: a caller stepping units one after another on a
        worker calls it for the next unit while the current one computes, so the reads of one
        unit overlap the update of the one before. Returns the keys started (store.prefetch:
        stops where the host tier has no room)."""
        self._check_index(u)
        pending = self.tiles.pending(u, self._completed + 1)
        if not pending:
            return []
        return self.store.prefetch([self.units[u].values_key, self.tiles.key(pending[0])])

    def finish_step(self) -> None:
        """Every unit has been stepped: completed steps += 1. Raises ValueError naming the
        units whose tiles do not all hold the step being built."""
        with self._lock:
            target = self._completed + 1
            missing = [u for u in range(len(self.units)) if self.tiles.pending(u, target)]
            if missing:
                raise ValueError(f"finish_step: units {missing} were not stepped for step {target}")
            self._completed = target

    def flush(self) -> None:
        """Wait for every write-back of the state; one that failed earlier is started again
        first. Raises the AIOError of a write-back that fails (call again to retry)."""
        for key in [self.tiles.key(t) for t in range(len(self.tiles))] \
                + [u.values_key for u in self.units]:
            self.tiles.rewrite_if_unsaved(key)
        self.store.flush()

    # -- state, for checkpoints ------------------------------------------------------------------

    def iter_state(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield (unit, {"step", "master", "exp_avg", "exp_avg_sq"}) one unit at a time (float32
        rows of the unit's numel): memory holds one unit's state and one tile."""
        for u in range(len(self.units)):
            yield u, {"step": self._completed, **unit_state(self.tiles, self.units, u)}

    def load_state(self, states: Iterable[tuple[int, dict[str, Any]]]) -> None:
        """Consume what iter_state yields (every unit, in order, all at one step), writing tiles
        as they fill; then every tile holds that step. A row may be a tensor or a RowSource
        (`_state`), read one tile at a time (memory holds a tile, not a row)."""
        for u in range(len(self.units)):  # a speculative step left undecided is dropped
            self.commit_unit(u)
        step = load_states(self.tiles, self.units, states)
        self._completed = step
        self.tiles.loaded(step)
        self.flush()

    # -- streaming ------------------------------------------------------------------------------

    def _stream(self, u: int, target: int, grad: GradPieces, grad_scale: float,
                lr: float, *, speculative: bool = False) -> None:
        """Bring every tile of unit u to step `target`. See [Note: retry-safe steps]."""
        todo = self.tiles.pending(u, target)
        for t in self.tiles.of_unit[u]:
            if t not in todo:
                self.tiles.rewrite_if_unsaved(self.tiles.key(t))
        keys = [self.tiles.key(t) for t in todo]
        streamed = self.state_tier == Tier.NVME  # tiles homed on the host never move: no hints,
        # no reading ahead
        if streamed:
            self.store.set_next_use({key: i for i, key in enumerate(keys)})
        values = self._values()
        try:
            if speculative:  # before any read: a unit without room reads nothing
                self._keep(u, todo, values)
            if todo:  # the unit's values are read with its first tile
                self.store.prefetch([self.units[u].values_key] + (keys[:1] if streamed else []))
                fmt = self.tiles.formats[u]
                hyper = dict(step=target, lr=lr, beta1=self.betas[0], beta2=self.betas[1],
                             eps=self.eps, adamw=self.adamw_mode, grad_scale=grad_scale,
                             pool=self._pool, seed=self.seed)
                kernels = UnitKernels(lambda wd: fmt.kernel(weight_decay=wd, **hyper),
                                      self.weight_decay, self._decay.get(u, ()))
            for i, (t, key) in enumerate(zip(todo, keys)):
                if streamed and i + 1 < len(keys):
                    self.store.prefetch(keys[i + 1:i + 2])
                tile = self.tiles[t]
                with self.tiles.updating(t, target) as entry:
                    self.tiles.format(t).step(kernels, entry, values.get(u)[tile.start:tile.stop],
                                              grad, tile.start, self._index(u, tile.start))
                    values.modified(u)
                    if streamed:
                        self.store.set_next_use({key: self._reuse_distance(t)})
            values.release(u)
            if not todo:  # a retry: values whose write-back failed
                self.tiles.rewrite_if_unsaved(self.units[u].values_key)
        finally:
            values.release_all()

    def _reuse_distance(self, t: int) -> int:
        """Fetches until tile t is needed again: at the next step, after every other tile and
        whatever else a step fetches (the store's fetches since its last update; at least one
        per tile). The forward's values, needed sooner, are then evicted after it."""
        now = self.store.clock
        last = self._updated_at.get(t)
        self._updated_at[t] = now
        return max(len(self.tiles), 0 if last is None else now - last)

    def _index(self, u: int, start: int) -> int:
        """The rounding counter of element `start` of unit u: unique to the element in the
        whole unit (ranks step disjoint slices of it), whatever the tiles."""
        return (u << _UNIT_INDEX_BITS) + self.units[u].offset + start

    def _values(self) -> UnitValues:
        return UnitValues(self.store, self.units)

    def _check_index(self, u: int) -> None:
        if isinstance(u, bool) or not isinstance(u, int) or not 0 <= u < len(self.units):
            raise ValueError(f"unit must be an int in [0, {len(self.units)}), got {u!r}")


def _check_unit(u: int, spec: UnitSpec, store: TensorStore) -> None:
    if isinstance(spec.numel, bool) or not isinstance(spec.numel, int) or spec.numel < 1:
        raise ValueError(f"unit {u}: numel must be an int >= 1, got {spec.numel!r}")
    if spec.dtype not in GRAD_DTYPES:
        raise ValueError(f"unit {u}: dtype {spec.dtype}; expected float32, bfloat16 or float16")
    if spec.values_key not in store:
        raise ValueError(f"unit {u}: values_key {spec.values_key!r} is not in the store")
    if isinstance(spec.offset, bool) or not isinstance(spec.offset, int) or spec.offset < 0:
        raise ValueError(f"unit {u}: offset must be an int >= 0, got {spec.offset!r}")


def _check_scale(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)
