"""Adam whose fp32 master weights and moments live in the store (NVMe), streamed through in tiles.

Two ways to cut the state into tiles (store entries of shape (rows, n)):

- param mode, `SwappedOptimizer(params, store)`: parameters laid end to end, cut into tiles of
  `tile_numel` elements (DeepSpeed's `sub_group_size`) independent of parameter sizes; each
  tile holds master, exp_avg, exp_avg_sq. `step()` updates every tile.
- unit mode, `SwappedOptimizer.from_units(units, store)`: each engine fetch unit (a module's
  parameters flattened, as FSDP's FlatParameter) is cut on its own, so `step_unit(u, grad)` can
  update unit u as soon as its gradient is final, from a worker thread while backward goes on.
  A float32 unit's values entry is its master (tiles hold exp_avg, exp_avg_sq); a bf16/fp16
  unit's tiles hold the fp32 master too and the kernel writes the rounded values in the same
  pass.

A pass streams tiles: read tile i+1 (prefetch), update tile i with the CPU Adam kernel, write it
back (asynchronously, on release) while the next one computes, so host memory holds a few tiles
whatever the model size and a step runs at the speed of the disk.

[Note: retry-safe steps] Each tile records the step it holds (`_tile_steps`). A pass updates
only tiles below the step being built, so after a pass raised (an I/O error on a read or a
write-back) the same call with the same gradients finishes the step and updates no tile twice.
Everything a pass fetches is released on every path; a tile (or values entry) is released
dirty once changed, and the store keeps a changed copy until its write-back succeeds. A pass
(and `flush()`) rewrites any entry of an already-updated tile whose write-back failed.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import torch
from torch.autograd.graph import increment_version

from infinity.memory import ThreadPool
from infinity.optim._native import AdamKernel, check_hyperparameters, check_threads
from infinity.optim._state import StreamedState
from infinity.optim._tiles import (
    GRAD_DTYPES,
    GradPieces,
    GroupValues,
    Segment,
    UnitSpec,
    all_finite,
    check_grad,
    check_grad_pieces,
    cut_per_group,
    cut_tiles,
    spans,
    tile_numel_of,
)
from infinity.store import TensorStore, Tier

logger = logging.getLogger(__name__)


__all__ = ["DecaySpan", "StepResult", "SwappedOptimizer", "UnitSpec"]


class StepResult(NamedTuple):
    applied: bool  # False when the gradients were not finite and the step was skipped
    grad_norm: float  # global L2 norm of the unscaled gradients (inf/nan when skipped)
    clip_coef: float  # factor the gradients were multiplied by (1.0 when not clipped)


def _check_scale(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


class SwappedOptimizer(StreamedState):
    """Adam / AdamW with all optimizer state in a TensorStore, streamed through in tiles.

    Args (param mode; see `from_units` for unit mode):
        params: CPU tensors (float32, bfloat16 or float16), contiguous.
        store: a TensorStore. With state_tier NVME: an NVMe budget for 12 bytes per parameter
            (rounded up per tile) and a host budget for at least 3 tiles (4 recommended).
        lr, betas, eps, weight_decay, adamw_mode: as in infinity.optim.CPUAdam. `lr` may be
            changed between steps (a scheduler).
        tile_numel: elements per tile (`sub_group_size`); the I/O unit of a step.
        max_grad_norm: clip the global gradient norm to this (0: no clipping).
        threads: kernel threads (default: all cores).
        name: prefix of the store keys, so several optimizers can share a store.
        param_keys: for each parameter, None (its values are `param.data`) or the store key of
            an entry of the parameter's shape and dtype that holds its values (e.g. on NVMe):
            master weights start from it and new values are written into it. The parameter
            tensor still carries the shape and `.grad`. Such a parameter is fetched to the host
            tier whole while its tiles are updated, so it must fit there beside 3 tiles.
        state_tier: home of the tiles: Tier.NVME (offload_optimizer nvme) or Tier.HOST (cpu).

    Non-finite gradients (`step`): with loss_scale != 1 (fp16 and a dynamic loss scaler) it is
    an overflow: the step is skipped (logged at info) for the scaler to lower the scale. With
    loss_scale 1 (fp32 / bf16) the step is skipped with a warning. Both count in
    `skipped_steps`, as DeepSpeed counts them; neither reads or writes any state.
    """

    def __init__(self, params: Iterable[torch.Tensor], store: TensorStore, *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True, tile_numel: int = 1 << 22,
                 max_grad_norm: float = 0.0, threads: int | None = None,
                 name: str = "optim", param_keys: Sequence[str | None] | None = None,
                 state_tier: Tier | str = Tier.NVME) -> None:
        self.params: list[torch.Tensor] | None = list(params)
        if not self.params:
            raise ValueError("SwappedOptimizer got no parameters")
        for i, p in enumerate(self.params):
            if not isinstance(p, torch.Tensor) or p.device.type != "cpu" or not p.is_contiguous():
                raise ValueError(f"param {i} must be a contiguous CPU tensor, got "
                                 f"{getattr(p, 'device', type(p))}")
            if p.dtype not in GRAD_DTYPES:
                raise ValueError(f"param {i} has dtype {p.dtype}; expected float32, bfloat16 or float16")
        self.param_keys = list(param_keys) if param_keys is not None else [None] * len(self.params)
        if len(self.param_keys) != len(self.params):
            raise ValueError(f"param_keys has {len(self.param_keys)} entries for {len(self.params)} params")
        if max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0, got {max_grad_norm}")
        self.max_grad_norm = max_grad_norm
        self.steps = [0] * len(self.params)  # per parameter, as torch counts them
        self.units: list[UnitSpec] | None = None
        self._configure(store, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        adamw_mode=adamw_mode, tile_numel=tile_numel, threads=threads, name=name,
                        state_tier=state_tier)
        self._set_groups(shapes=[p.shape for p in self.params], dtypes=[p.dtype for p in self.params],
                         keys=self.param_keys, host=self.params, master_row=[True] * len(self.params),
                         tiles=cut_tiles([p.numel() for p in self.params], tile_numel))

    @classmethod
    def from_units(cls, units: Sequence[UnitSpec], store: TensorStore, *, lr: float = 1e-3,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                   weight_decay: float = 0.0, adamw_mode: bool = True, tile_numel: int = 1 << 22,
                   threads: int | None = None, name: str = "optim",
                   state_tier: Tier | str = Tier.NVME) -> SwappedOptimizer:
        """An optimizer over engine fetch units, stepped one unit at a time (`step_unit`).

        Each unit's values are a 1-D store entry (`UnitSpec.values_key`). Tiles are cut per
        unit. float32 unit: the values entry is the fp32 master, tiles hold exp_avg and
        exp_avg_sq (8 B/element). bf16/fp16 unit: tiles hold an fp32 master (started from the
        values, upcast) and the moments (12 B/element); new values are rounded into the values
        entry. A unit's values entry is fetched to the host tier whole while its tiles are
        updated: the host budget must hold it beside 3 tiles per concurrent `step_unit`.

        With `UnitSpec.offset` a unit steps elements [offset, offset + numel) of its values
        entry and leaves the rest alone: a data-parallel rank owning a slice of a unit whose
        values every rank holds whole (ZeRO stages 1 and 2). Its gradient has `numel` elements.
        An entry stepped from offset 0 must hold exactly `numel` elements.
        """
        self = cls.__new__(cls)
        self.params, self.param_keys, self.max_grad_norm = None, [], 0.0
        self.units = [UnitSpec(*u) for u in units]
        if not self.units:
            raise ValueError("SwappedOptimizer.from_units got no units")
        for u, spec in enumerate(self.units):
            if isinstance(spec.numel, bool) or not isinstance(spec.numel, int) or spec.numel < 1:
                raise ValueError(f"unit {u}: numel must be an int >= 1, got {spec.numel!r}")
            if spec.dtype not in GRAD_DTYPES:
                raise ValueError(f"unit {u}: dtype {spec.dtype}; expected float32, bfloat16 or float16")
            if spec.values_key not in store:
                raise ValueError(f"unit {u}: values_key {spec.values_key!r} is not in the store")
            if isinstance(spec.offset, bool) or not isinstance(spec.offset, int) or spec.offset < 0:
                raise ValueError(f"unit {u}: offset must be an int >= 0, got {spec.offset!r}")
        self._configure(store, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        adamw_mode=adamw_mode, tile_numel=tile_numel, threads=threads, name=name,
                        state_tier=state_tier)
        self._set_groups(shapes=[torch.Size([u.numel]) for u in self.units],
                         dtypes=[u.dtype for u in self.units],
                         keys=[u.values_key for u in self.units], host=None,
                         offsets=[u.offset for u in self.units], master_row=[u.dtype != torch.float32 for u in self.units],
                         tiles=cut_per_group([u.numel for u in self.units], tile_numel))
        return self

    # -- set-up ---------------------------------------------------------------------------------

    def _configure(self, store: TensorStore, *, lr: float, betas: tuple[float, float], eps: float,
                   weight_decay: float, adamw_mode: bool, tile_numel: int, threads: int | None,
                   name: str, state_tier: Tier | str) -> None:
        if isinstance(tile_numel, bool) or not isinstance(tile_numel, int) or tile_numel < 1:
            raise ValueError(f"tile_numel must be an int >= 1, got {tile_numel!r}")
        check_hyperparameters(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
        # Kernel workers, started once: a pass makes a kernel call per tile segment. Units stepped
        # from several threads take turns on them (each call already uses every core).
        self._pool = ThreadPool(check_threads(threads))  # wrong values fail here, not at a step
        self.state_tier = Tier.of(state_tier)
        if self.state_tier == Tier.DEVICE:
            raise ValueError("state_tier must be Tier.NVME or Tier.HOST: the CPU kernel updates host memory")
        self.lr, self.betas, self.eps = lr, (float(betas[0]), float(betas[1])), eps
        self.weight_decay, self.adamw_mode = weight_decay, adamw_mode
        self.store, self.name, self.tile_numel = store, name, tile_numel
        self.skipped_steps = 0  # steps skipped for non-finite gradients (fp16 overflow included)
        # group -> its own weight decays: spans, and their stops (to bisect)
        self._decay: dict[int, tuple[list[DecaySpan], list[int]]] = {}
        self._completed = 0  # steps applied; tiles hold this step between steps
        self._lock = threading.Lock()  # finish_step against itself

    def _set_groups(self, *, shapes: list[torch.Size], dtypes: list[torch.dtype],
                    keys: list[str | None], host: list[torch.Tensor] | None,
                    master_row: list[bool], tiles: list[list[Segment]],
                    offsets: list[int] | None = None) -> None:
        """Record what is stepped (parameters or units) and how it is tiled; write the tiles."""
        self._shapes, self._dtypes, self._keys, self._host = shapes, dtypes, keys, host
        self._offsets = offsets
        self._numels = [math.prod(s) for s in shapes]
        self._master_row = master_row
        self.tiles = tiles
        self._tile_master = [master_row[t[0].param] for t in tiles]
        self._tile_steps = [0] * len(tiles)  # See [Note: retry-safe steps]
        self._by_group: list[list[tuple[int, Segment]]] = [[] for _ in shapes]
        for t, segments in enumerate(tiles):
            for seg in segments:
                self._by_group[seg.param].append((t, seg))
        self._group_tiles = [[t for t, _ in pairs] for pairs in self._by_group]
        self._check_budgets()
        self._write_initial_state()

    def _key(self, tile: int) -> str:
        return f"{self.name}/tile{tile}"

    def _check_budgets(self) -> None:
        if self.state_tier == Tier.HOST:
            if not self.store.budgets.get(Tier.HOST):
                raise ValueError("state_tier HOST needs a store with a host budget")
            return
        if not self.store.budgets.get(Tier.NVME):
            raise ValueError("SwappedOptimizer needs a store with an NVMe budget for its state "
                             "(or state_tier=Tier.HOST)")
        rows, numel = max((3 if master else 2, tile_numel_of(segments))
                          for master, segments in zip(self._tile_master, self.tiles))
        tile_nbytes = rows * 4 * numel
        host = self.store.budgets.get(Tier.HOST, 0)
        if len(self.tiles) > 1 and host < 3 * tile_nbytes:
            raise ValueError(
                f"the store's host budget ({host} bytes) must hold at least 3 optimizer tiles of "
                f"{tile_nbytes} bytes (tile_numel={self.tile_numel}: {rows * 4} bytes per element) "
                f"to stream; raise the host budget or lower tile_numel (sub_group_size)"
            )

    def _values(self) -> GroupValues:
        return GroupValues(self.store, self._keys, self._host, self._numels, self._dtypes, self._offsets)

    def _write_initial_state(self) -> None:
        values = self._values()
        try:
            last = _last_tile_of(self.tiles, range(len(self.tiles)))
            for t, segments in enumerate(self.tiles):
                master = self._tile_master[t]
                tile = torch.zeros(3 if master else 2, tile_numel_of(segments))
                for seg in segments if master else ():
                    part, cols = spans(seg)
                    tile[0, cols] = values.get(seg.param)[part]
                for group in last.get(t, ()):
                    values.release(group)
                self.store.put(self._key(t), tile, self.state_tier)
        except BaseException:
            for t in range(len(self.tiles)):  # nothing half-made stays in the store
                if self._key(t) in self.store:
                    self.store.drop(self._key(t))
            raise
        finally:
            values.release_all()

    # -- param mode -----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, *, loss_scale: float = 1.0) -> StepResult:
        """One optimizer step over every tile (param mode).

        `loss_scale` is what the loss was multiplied by (fp16); gradients are divided by it
        inside the kernel, together with the clip factor. Non-finite gradients skip the step
        without I/O (see the class docstring). If it raises (an I/O error), call it again with
        the same gradients: see [Note: retry-safe steps].
        """
        if self.params is None:
            raise TypeError("step() is for param mode; an optimizer from from_units() steps with "
                            "begin_step / step_unit / finish_step")
        loss_scale = _check_scale("loss_scale", loss_scale)
        grads = [p.grad for p in self.params]
        for i, g in enumerate(grads):
            if g is not None:
                check_grad(f"param {i}'s gradient", g, self._numels[i])
        norm = _global_norm(grads) / loss_scale
        if not math.isfinite(norm):
            self.skipped_steps += 1
            if loss_scale != 1.0:
                logger.info("gradient overflow (norm %s at loss scale %s): step skipped", norm, loss_scale)
            else:
                logger.warning("non-finite gradients (norm %s): step skipped (%d skipped so far)",
                               norm, self.skipped_steps)
            return StepResult(False, norm, 1.0)
        clip = 1.0
        if self.max_grad_norm > 0:
            clip = min(1.0, self.max_grad_norm / (norm + 1e-6))
        target = self._completed + 1
        steps = [s + 1 if g is not None else s for s, g in zip(self.steps, grads)]
        self._stream(range(len(self.tiles)), target, grads.__getitem__, steps.__getitem__,
                     clip / loss_scale, self.lr)
        self.steps, self._completed = steps, target
        return StepResult(True, norm, clip)

    # -- unit mode ------------------------------------------------------------------------------

    @property
    def completed_steps(self) -> int:
        """Steps applied (param mode: `step()` calls not skipped; unit mode: `finish_step()`s)."""
        return self._completed

    def begin_step(self) -> int:
        """The number of the step being built (completed steps + 1); idempotent until
        `finish_step()`. Calling it is optional: `step_unit` always builds this step."""
        return self._completed + 1

    @torch.no_grad()
    def step_unit(self, u: int, grad: torch.Tensor | Sequence[torch.Tensor], *, grad_scale: float = 1.0,
                  check_finite: bool = True, lr: float | None = None) -> None:
        """Update unit u's tiles for the step being built.

        `grad`: the unit's gradient, a 1-D contiguous CPU tensor of its numel
        (float32/bfloat16/float16), or a list of such tensors laid end to end (its parameters'
        own gradients: the kernel reads each where it lies, nothing is joined); multiplied by
        `grad_scale` (clip factor / loss scale, decided by the caller) inside the kernel.
        Non-finite gradients raise ValueError before anything is updated: overflow and skipped
        steps are decided by the caller over all units. The check is one pass over the gradient
        (a sum); `check_finite=False` skips it for a caller that has checked already (e.g. from
        the gradient norm it computes for clipping). `lr`: this step's learning rate (default
        `self.lr`), for a caller whose schedule moves on while units of a step are still being
        stepped. Retry-safe (see [Note: retry-safe steps]); safe for different units from
        different threads at once.
        """
        self._unit(u, "step_unit")
        grad_scale = _check_scale("grad_scale", grad_scale)
        pieces = check_grad_pieces(f"unit {u}'s gradient", grad, self._numels[u])
        if check_finite and not all(all_finite(g) for g in pieces.pieces):
            raise ValueError(f"unit {u}'s gradient has non-finite values (inf/nan); check for "
                             f"overflow before stepping and skip the whole step")
        target = self._completed + 1
        lr = self.lr if lr is None else lr
        check_hyperparameters(lr=lr, beta1=self.betas[0], beta2=self.betas[1], eps=self.eps,
                              weight_decay=self.weight_decay)
        self._stream(self._group_tiles[u], target, lambda _: pieces, lambda _: target, grad_scale, lr)

    def prefetch_unit(self, u: int) -> list[str]:
        """Start reading unit u's first tile not yet at the step being built (and the values
        it updates), without holding anything: a caller stepping units one after another on a
        worker calls it for the next unit while the current one computes, so the reads of one
        unit overlap the update of the one before. Returns the keys started (store.prefetch:
        stops where the host tier has no room)."""
        self._unit(u, "prefetch_unit")
        target = self._completed + 1
        t = next((t for t in self._group_tiles[u] if self._tile_steps[t] < target), None)
        if t is None:
            return []
        return self.store.prefetch([k for k in (self._keys[s.param] for s in self.tiles[t]) if k] + [self._key(t)])

    def finish_step(self) -> None:
        """Every unit has been stepped: completed steps += 1. Raises ValueError naming the
        units whose tiles do not all hold the step being built."""
        self._unit(0, "finish_step")
        with self._lock:
            target = self._completed + 1
            missing = [u for u, tiles in enumerate(self._group_tiles)
                       if any(self._tile_steps[t] < target for t in tiles)]
            if missing:
                raise ValueError(f"finish_step: units {missing} were not stepped for step {target}")
            self._completed = target

    def set_weight_decay(self, u: int, spans: Sequence[DecaySpan]) -> None:
        """Give elements [start, stop) of what unit u steps their own weight decay (a client's
        parameter groups: decay on weights, none on biases and norms); elements no span covers
        keep the optimizer's `weight_decay`. The kernel is called once per range."""
        self._unit(u, "set_weight_decay")
        checked = sorted(DecaySpan(int(a), int(b), float(wd)) for a, b, wd in spans)
        end = 0
        for span in checked:
            if not end <= span.start < span.stop <= self._numels[u]:
                raise ValueError(f"unit {u}: weight decay spans must be disjoint ranges within "
                                 f"[0, {self._numels[u]}), got {span[:2]}")
            check_hyperparameters(lr=self.lr, beta1=self.betas[0], beta2=self.betas[1],
                                  eps=self.eps, weight_decay=span.weight_decay)
            end = span.stop
        self._decay[u] = (checked, [span.stop for span in checked])

    def _unit(self, u: int, verb: str) -> None:
        if self.units is None:
            raise TypeError(f"{verb}() is for unit mode (SwappedOptimizer.from_units); use step()")
        if isinstance(u, bool) or not isinstance(u, int) or not 0 <= u < len(self.units):
            raise ValueError(f"unit must be an int in [0, {len(self.units)}), got {u!r}")

    # -- streaming ------------------------------------------------------------------------------

    def _stream(self, tiles: Iterable[int], target: int,
                grad_of: Callable[[int], torch.Tensor | GradPieces | None],
                step_of: Callable[[int], int], grad_scale: float, lr: float) -> None:
        """Bring every tile in `tiles` to step `target`. See [Note: retry-safe steps]."""
        tiles = list(tiles)
        todo = [t for t in tiles if self._tile_steps[t] < target]
        for t in tiles:
            if self._tile_steps[t] >= target:
                self._rewrite_if_unsaved(self._key(t))
        keys = [self._key(t) for t in todo]
        streamed = self.state_tier == Tier.NVME  # host-homed tiles never move: no hints, no reading ahead
        if streamed:
            self.store.set_next_use({key: i for i, key in enumerate(keys)})
        last = _last_tile_of(self.tiles, todo)
        kernels: dict[tuple[int, float], AdamKernel] = {}  # by step and decay: few per pass

        def kernel_of(group: int, weight_decay: float) -> AdamKernel:
            key = (step_of(group), weight_decay)
            if key not in kernels:
                kernels[key] = AdamKernel(step=key[0], lr=lr, beta1=self.betas[0],
                                          beta2=self.betas[1], eps=self.eps,
                                          weight_decay=weight_decay, adamw=self.adamw_mode,
                                          grad_scale=grad_scale, pool=self._pool)
            return kernels[key]

        values = self._values()
        held: str | None = None
        try:
            first = self.tiles[todo[0]] if todo else []  # its values entries are read with it
            self.store.prefetch([k for k in (self._keys[s.param] for s in first) if k] + (keys[:1] if streamed else []))
            for i, (t, key) in enumerate(zip(todo, keys)):
                if streamed and i + 1 < len(keys):
                    self.store.prefetch(keys[i + 1:i + 2])
                future = self.store.fetch(key, Tier.HOST)
                held = key
                self._update_tile(t, future.result(), grad_of, kernel_of, values)
                self._tile_steps[t] = target
                if streamed:  # done for this step: needed again at the next one, after every other tile
                    self.store.set_next_use({key: len(self.tiles)})
                held = None
                self.store.release(key, Tier.HOST, dirty=True)
                for group in last.get(t, ()):
                    values.release(group)
            for group in {s.param for t in tiles for s in self.tiles[t]} - {s.param for t in todo for s in self.tiles[t]}:
                if self._keys[group] is not None:  # a retry: values whose write-back failed
                    self._rewrite_if_unsaved(self._keys[group])
        finally:
            try:
                if held is not None:
                    self.store.release(held, Tier.HOST)
            finally:
                values.release_all()

    def _update_tile(self, t: int, tile: torch.Tensor,
                     grad_of: Callable[[int], torch.Tensor | GradPieces | None],
                     kernel_of: Callable[[int, float], AdamKernel], values: GroupValues) -> None:
        """Run the kernel over tile t's segments (one call per gradient piece in a segment and
        weight decay range);
        every input is fetched first, so a tile is updated whole or not at all. The tensors are
        slices of one length of checked gradients, tiles and values (see AdamKernel)."""
        work = [(seg, grad_of(seg.param)) for seg in self.tiles[t]]
        work = [(seg, grad, values.get(seg.param)) for seg, grad in work if grad is not None]
        master_row = self._tile_master[t]
        for seg, grad, flat in work:
            part, cols = spans(seg)
            out = flat[part]
            if master_row:
                master, exp_avg, exp_avg_sq = tile[0, cols], tile[1, cols], tile[2, cols]
            else:  # a float32 unit: its values are the master
                master, exp_avg, exp_avg_sq = out, tile[0, cols], tile[1, cols]
            lowp = out if out.dtype != torch.float32 else None
            pieces = grad if isinstance(grad, GradPieces) else GradPieces([grad.view(-1)])
            for first, g in pieces.ranges(part.start, part.stop):
                decays = _decay_ranges(self._decay.get(seg.param), first, first + g.numel(),
                                       self.weight_decay)
                for lo, hi, decay in decays:
                    at = slice(lo - part.start, hi - part.start)
                    kernel_of(seg.param, decay)(master[at], g[lo - first:hi - first], exp_avg[at],
                                                exp_avg_sq[at], None if lowp is None else lowp[at])
            if master_row and lowp is None:
                out.copy_(master)
            increment_version(out)  # as an in-place op would: a graph that saved the values fails loudly
            values.modified(seg.param)

    def _rewrite_if_unsaved(self, key: str) -> None:
        """Start the write-back again of an entry whose last one failed (the store kept the
        changed host copy)."""
        if not self.store.unsaved(key):
            return
        future = self.store.fetch(key, Tier.HOST)
        done = False
        try:
            future.result()
            done = True
        finally:
            self.store.release(key, Tier.HOST, dirty=done)

    def flush(self) -> None:
        """Wait for every write-back of the state; one that failed earlier is started again
        first. Raises the AIOError of a write-back that fails (call again to retry)."""
        for key in [self._key(t) for t in range(len(self.tiles))] + [k for k in self._keys if k]:
            self._rewrite_if_unsaved(key)
        self.store.flush()


class DecaySpan(NamedTuple):
    """Elements [start, stop) of a unit, stepped with their own weight decay."""

    start: int
    stop: int
    weight_decay: float


def _decay_ranges(decay: tuple[list[DecaySpan], list[int]] | None, start: int, stop: int,
                  default: float) -> Iterator[tuple[int, int, float]]:
    """[start, stop) cut where its weight decay changes: (lo, hi, weight decay), in order
    (`decay`: a unit's spans and their stops, as `set_weight_decay` keeps them)."""
    if decay is None:
        yield start, stop, default
        return
    spans, stops = decay
    at = start
    for span in itertools.islice(spans, bisect.bisect_right(stops, start), None):
        if span.start >= stop:
            break
        if span.start > at:
            yield at, span.start, default
        lo, hi = max(at, span.start), min(stop, span.stop)
        yield lo, hi, span.weight_decay
        at = hi
    if at < stop:
        yield at, stop, default


def _last_tile_of(tiles: list[list[Segment]], order: Iterable[int]) -> dict[int, list[int]]:
    """tile -> the groups whose last segment in `order` it holds (their values can go then)."""
    last: dict[int, int] = {}
    for t in order:
        for seg in tiles[t]:
            last[seg.param] = t
    by_tile: dict[int, list[int]] = {}
    for group, t in last.items():
        by_tile.setdefault(t, []).append(group)
    return by_tile


def _global_norm(grads: list[torch.Tensor | None]) -> float:
    """L2 norm over every gradient, accumulated in float32 (float64 for the sum of squares)."""
    total = 0.0
    for g in grads:
        if g is not None:
            total += float(torch.linalg.vector_norm(g, dtype=torch.float32)) ** 2
    return math.sqrt(total)
