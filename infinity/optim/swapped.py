"""Adam whose fp32 master weights and moments live on NVMe, streamed through in fixed tiles.

All parameters are laid end to end in one flat index space, cut into tiles of `tile_numel`
elements (DeepSpeed's `sub_group_size`), independent of parameter sizes. Tile i is one store
entry of shape (3, n): master weights, exp_avg, exp_avg_sq. A step streams the tiles: read
tile i+1 (prefetch), update tile i with the CPU Adam kernel, write tile i back (asynchronously
on release) while the next one computes, so host memory holds a few tiles whatever the model
size and the step runs at the speed of the disk.

Gradients stay in host memory (param.grad) and are read in place; the new parameter values are
written into param.data (rounded to its dtype by the kernel). The global gradient norm and fp16
overflow are computed from the gradients alone, before any state is read, so a skipped step
costs no I/O.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from infinity.optim._native import adam_step, check_hyperparameters, check_threads
from infinity.store import TensorStore, Tier

logger = logging.getLogger(__name__)

_TILE_ROWS = 3  # master, exp_avg, exp_avg_sq
_STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")


class Segment(NamedTuple):
    """The part of one parameter that falls in one tile."""

    param: int  # index into the optimizer's parameters
    param_offset: int  # first element in the flattened parameter
    tile_offset: int  # first element in the tile
    numel: int


class StepResult(NamedTuple):
    applied: bool  # False when the gradients overflowed and the step was skipped
    grad_norm: float  # global L2 norm of the unscaled gradients (inf/nan on overflow)
    clip_coef: float  # factor the gradients were multiplied by (1.0 when not clipped)


class SwappedOptimizer:
    """Adam / AdamW over CPU parameters with all optimizer state in the store's NVMe tier.

    Args:
        params: CPU tensors (float32, bfloat16 or float16), contiguous.
        store: a TensorStore with an NVMe budget for 12 bytes per parameter (rounded up per
            tile) and a host budget for at least 3 tiles (4 recommended).
        lr, betas, eps, weight_decay, adamw_mode: as in infinity.optim.CPUAdam.
        tile_numel: elements per tile (`sub_group_size`); the I/O unit of a step.
        max_grad_norm: clip the global gradient norm to this (0: no clipping).
        threads: kernel threads (default: all cores).
        name: prefix of the store keys, so several optimizers can share a store.
        param_keys: for each parameter, None (its values are `param.data`) or the store key of
            an entry of the parameter's shape and dtype that holds its values (e.g. on NVMe):
            master weights start from it and new values are written into it. The parameter
            tensor still carries the shape and `.grad`. Such a parameter is fetched to the host
            tier whole while its tiles are updated, so it must fit there beside 3 tiles.
    """

    def __init__(self, params: Iterable[torch.Tensor], store: TensorStore, *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True, tile_numel: int = 1 << 22,
                 max_grad_norm: float = 0.0, threads: int | None = None,
                 name: str = "optim", param_keys: Sequence[str | None] | None = None) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("SwappedOptimizer got no parameters")
        for i, p in enumerate(self.params):
            if not isinstance(p, torch.Tensor) or p.device.type != "cpu" or not p.is_contiguous():
                raise ValueError(f"param {i} must be a contiguous CPU tensor, got "
                                 f"{getattr(p, 'device', type(p))}")
            if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"param {i} has dtype {p.dtype}; expected float32, bfloat16 or float16")
        self.param_keys = list(param_keys) if param_keys is not None else [None] * len(self.params)
        if len(self.param_keys) != len(self.params):
            raise ValueError(f"param_keys has {len(self.param_keys)} entries for {len(self.params)} params")
        if tile_numel < 1:
            raise ValueError(f"tile_numel must be >= 1, got {tile_numel}")
        if max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0, got {max_grad_norm}")
        check_hyperparameters(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
        check_threads(threads)  # wrong values fail here, not at the first step
        self.lr, self.betas, self.eps = lr, (float(betas[0]), float(betas[1])), eps
        self.weight_decay, self.adamw_mode = weight_decay, adamw_mode
        self.max_grad_norm, self.threads = max_grad_norm, threads
        self.store, self.name = store, name
        self.steps = [0] * len(self.params)  # per parameter, as torch counts them
        self.tile_numel = tile_numel
        self.tiles = _cut_tiles([p.numel() for p in self.params], tile_numel)
        self._by_param: dict[int, list[tuple[int, Segment]]] = {}  # param -> its (tile, segment)s
        for t, segments in enumerate(self.tiles):
            for seg in segments:
                self._by_param.setdefault(seg.param, []).append((t, seg))
        self._check_budgets()
        self._write_initial_state()

    # -- set-up ---------------------------------------------------------------------------------

    def _key(self, tile: int) -> str:
        return f"{self.name}/tile{tile}"

    def _tile_numel(self, tile: int) -> int:
        last = self.tiles[tile][-1]
        return last.tile_offset + last.numel

    def _check_budgets(self) -> None:
        tile_nbytes = _TILE_ROWS * 4 * self.tile_numel
        host = self.store.budgets.get(Tier.HOST, 0)
        if len(self.tiles) > 1 and host < 3 * tile_nbytes:
            raise ValueError(
                f"the store's host budget ({host} bytes) must hold at least 3 optimizer tiles of "
                f"{tile_nbytes} bytes (tile_numel={self.tile_numel}: 12 bytes per element) to "
                f"stream; raise the host budget or lower tile_numel (sub_group_size)"
            )
        if not self.store.budgets.get(Tier.NVME):
            raise ValueError("SwappedOptimizer needs a store with an NVMe budget for its state")

    def _write_initial_state(self) -> None:
        values = _ParamValues(self)
        for t, segments in enumerate(self.tiles):
            tile = torch.zeros(_TILE_ROWS, self._tile_numel(t))
            for seg in segments:
                flat = values.get(seg.param)
                tile[0, seg.tile_offset:seg.tile_offset + seg.numel] = flat[seg.param_offset:seg.param_offset + seg.numel]
                values.segment_done(seg, dirty=False)
            self.store.put(self._key(t), tile, Tier.NVME)

    # -- the step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, *, loss_scale: float = 1.0) -> StepResult:
        """One optimizer step over every tile; skipped (no I/O) when gradients overflow.

        `loss_scale` is what the loss was multiplied by (fp16); gradients are divided by it
        inside the kernel, together with the clip factor.
        """
        grads = [p.grad for p in self.params]
        norm = _global_norm(grads) / loss_scale
        if not math.isfinite(norm):
            logger.info("gradient overflow (norm %s): step skipped", norm)
            return StepResult(False, norm, 1.0)
        clip = 1.0
        if self.max_grad_norm > 0:
            clip = min(1.0, self.max_grad_norm / (norm + 1e-6))
        grad_scale = clip / loss_scale
        live = [g is not None for g in grads]
        steps = [s + 1 if ok else s for s, ok in zip(self.steps, live)]
        keys = [self._key(t) for t in range(len(self.tiles))]
        self.store.set_next_use({key: t for t, key in enumerate(keys)})
        self.store.prefetch(keys[:1])
        values = _ParamValues(self)
        for t, key in enumerate(keys):
            if t + 1 < len(keys):
                self.store.prefetch(keys[t + 1:t + 2])
            tile = self.store.fetch(key, Tier.HOST).result()
            self._update_tile(t, tile, grads, steps, grad_scale, values)
            # Done for this step: needed again at the next one, after every tile still to come.
            self.store.set_next_use({key: len(keys)})
            self.store.release(key, Tier.HOST, dirty=True)
        self.steps = steps
        return StepResult(True, norm, clip)

    def _update_tile(self, t: int, tile: torch.Tensor, grads: list[torch.Tensor | None],
                     steps: list[int], grad_scale: float, values: _ParamValues) -> None:
        for seg in self.tiles[t]:
            grad = grads[seg.param]
            if grad is None:
                continue
            p = self.params[seg.param]
            part = slice(seg.param_offset, seg.param_offset + seg.numel)
            cols = slice(seg.tile_offset, seg.tile_offset + seg.numel)
            master, out = tile[0, cols], values.get(seg.param)[part]
            adam_step(master, grad.view(-1)[part], tile[1, cols], tile[2, cols], step=steps[seg.param],
                      lr=self.lr, beta1=self.betas[0], beta2=self.betas[1], eps=self.eps,
                      weight_decay=self.weight_decay, adamw=self.adamw_mode, grad_scale=grad_scale,
                      out_lowp=None if p.dtype == torch.float32 else out, threads=self.threads)
            if p.dtype == torch.float32:
                out.copy_(master)
            values.segment_done(seg, dirty=True)

    # -- state, streamed ------------------------------------------------------------------------

    def iter_state(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield (param index, {"step", "master", "exp_avg", "exp_avg_sq"}) one parameter at a
        time: memory holds one parameter's state and one tile, whatever the model size."""
        for i in range(len(self.params)):
            yield i, self._param_state(i)

    def _param_state(self, i: int) -> dict[str, Any]:
        state = {name: torch.empty(self.params[i].shape, dtype=torch.float32) for name in _STATE_NAMES}
        for t, seg in self._by_param.get(i, []):
            tile = self.store.fetch(self._key(t), Tier.HOST).result()
            for row, name in enumerate(_STATE_NAMES):
                state[name].view(-1)[seg.param_offset:seg.param_offset + seg.numel] = \
                    tile[row, seg.tile_offset:seg.tile_offset + seg.numel]
            self.store.release(self._key(t), Tier.HOST)
        return {"step": self.steps[i], **state}

    def load_state(self, states: Iterable[tuple[int, dict[str, Any]]]) -> None:
        """Consume what iter_state yields (parameters in order), writing tiles as they fill.
        A state without "master" takes the parameter's current value (torch state dicts)."""
        held: int | None = None
        expected = 0
        for i, state in states:
            if i != expected:
                raise ValueError(f"load_state expects parameters in order: got {i}, expected {expected}")
            expected += 1
            p = self.params[i]
            values = {name: state.get(name, p.detach() if name == "master" else None) for name in _STATE_NAMES}
            for name, value in values.items():
                if value is None or tuple(value.shape) != tuple(p.shape):
                    raise ValueError(f"param {i}: state {name!r} has shape "
                                     f"{None if value is None else tuple(value.shape)}, expected {tuple(p.shape)}")
            for t, segments in enumerate(self.tiles):
                for s in (s for s in segments if s.param == i):
                    if held != t:
                        if held is not None:
                            self.store.release(self._key(held), Tier.HOST, dirty=True)
                        tile, held = self.store.fetch(self._key(t), Tier.HOST).result(), t
                    for row, name in enumerate(_STATE_NAMES):
                        tile[row, s.tile_offset:s.tile_offset + s.numel] = \
                            values[name].reshape(-1)[s.param_offset:s.param_offset + s.numel]
            self.steps[i] = int(state["step"])
        if held is not None:
            self.store.release(self._key(held), Tier.HOST, dirty=True)
        if expected != len(self.params):
            raise ValueError(f"load_state got {expected} parameters, the optimizer has {len(self.params)}")
        self.store.flush()

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's format: state by parameter index, plus one param group.

        The "state" mapping is lazy: each parameter's moments are read from NVMe when its
        entry is accessed, so iterating it (as torch's load_state_dict and checkpoint writers
        do) holds one parameter's state at a time. torch.save of it materialises everything.
        """
        group = {"lr": self.lr, "betas": self.betas, "eps": self.eps,
                 "weight_decay": self.weight_decay, "amsgrad": False, "maximize": False,
                 "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                 "decoupled_weight_decay": self.adamw_mode, "params": list(range(len(self.params)))}
        return {"state": _LazyState(self), "param_groups": [group]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's Adam/AdamW format (master weights are taken from the parameters)."""
        state = state_dict["state"]

        def states() -> Iterator[tuple[int, dict[str, Any]]]:
            for i, p in enumerate(self.params):
                s = state.get(i) or state.get(str(i))
                if s is None:
                    zeros = torch.zeros(p.shape)
                    yield i, {"step": 0, "exp_avg": zeros, "exp_avg_sq": zeros}
                else:
                    yield i, {"step": int(float(s["step"])), "exp_avg": s["exp_avg"],
                              "exp_avg_sq": s["exp_avg_sq"]}

        self.load_state(states())


class _LazyState(Mapping[int, dict[str, Any]]):
    """torch-format optimizer state, read from the tiles one parameter at a time on access."""

    def __init__(self, optimizer: SwappedOptimizer) -> None:
        self._opt = optimizer

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not isinstance(i, int) or not 0 <= i < len(self._opt.params) or not self._opt.steps[i]:
            raise KeyError(i)
        s = self._opt._param_state(i)
        return {"step": torch.tensor(float(s["step"])), "exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"]}

    def __iter__(self) -> Iterator[int]:
        return (i for i, step in enumerate(self._opt.steps) if step)

    def __len__(self) -> int:
        return sum(1 for step in self._opt.steps if step)


class _ParamValues:
    """Where each parameter's values are during one pass over the tiles: `param.data`, or its
    store entry, fetched to the host when its first segment comes and released (written back
    if changed) after its last, so a parameter spanning many tiles is read and written once."""

    def __init__(self, optimizer: SwappedOptimizer) -> None:
        self._opt = optimizer
        self._held: dict[int, torch.Tensor] = {}

    def get(self, i: int) -> torch.Tensor:
        """The flat values of parameter i."""
        key = self._opt.param_keys[i]
        if key is None:
            return self._opt.params[i].data.view(-1)
        if i not in self._held:
            self._held[i] = self._opt.store.fetch(key, Tier.HOST).result().view(-1)
        return self._held[i]

    def segment_done(self, seg: Segment, *, dirty: bool) -> None:
        key = self._opt.param_keys[seg.param]
        if key is not None and seg.param_offset + seg.numel == self._opt.params[seg.param].numel():
            if self._held.pop(seg.param, None) is not None:
                self._opt.store.release(key, Tier.HOST, dirty=dirty)


def _cut_tiles(numels: list[int], tile_numel: int) -> list[list[Segment]]:
    """Cut parameters laid end to end into tiles of tile_numel elements (the last may be short)."""
    tiles: list[list[Segment]] = [[]]
    used = 0
    for i, numel in enumerate(numels):
        done = 0
        while done < numel:
            if used == tile_numel:
                tiles.append([])
                used = 0
            take = min(numel - done, tile_numel - used)
            tiles[-1].append(Segment(i, done, used, take))
            used += take
            done += take
    return [t for t in tiles if t]


def _global_norm(grads: list[torch.Tensor | None]) -> float:
    """L2 norm over every gradient, accumulated in float32 (float64 for the sum of squares)."""
    total = 0.0
    for g in grads:
        if g is not None:
            total += float(torch.linalg.vector_norm(g, dtype=torch.float32)) ** 2
    return math.sqrt(total)
