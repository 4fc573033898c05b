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
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch

from infinity.optim._native import adam_step
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
    """

    def __init__(self, params: Iterable[torch.Tensor], store: TensorStore, *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True, tile_numel: int = 1 << 22,
                 max_grad_norm: float = 0.0, threads: int | None = None,
                 name: str = "optim") -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("SwappedOptimizer got no parameters")
        for i, p in enumerate(self.params):
            if not isinstance(p, torch.Tensor) or p.device.type != "cpu" or not p.is_contiguous():
                raise ValueError(f"param {i} must be a contiguous CPU tensor, got "
                                 f"{getattr(p, 'device', type(p))}")
            if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"param {i} has dtype {p.dtype}; expected float32, bfloat16 or float16")
        if tile_numel < 1:
            raise ValueError(f"tile_numel must be >= 1, got {tile_numel}")
        if max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0, got {max_grad_norm}")
        self.lr, self.betas, self.eps = lr, (float(betas[0]), float(betas[1])), eps
        self.weight_decay, self.adamw_mode = weight_decay, adamw_mode
        self.max_grad_norm, self.threads = max_grad_norm, threads
        self.store, self.name = store, name
        self.steps = [0] * len(self.params)  # per parameter, as torch counts them
        self.tile_numel = tile_numel
        self.tiles = _cut_tiles([p.numel() for p in self.params], tile_numel)
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
        for t, segments in enumerate(self.tiles):
            tile = torch.zeros(_TILE_ROWS, self._tile_numel(t))
            for s in segments:
                flat = self.params[s.param].detach().view(-1)
                tile[0, s.tile_offset:s.tile_offset + s.numel] = flat[s.param_offset:s.param_offset + s.numel]
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
        for t, key in enumerate(keys):
            if t + 1 < len(keys):
                self.store.prefetch(keys[t + 1:t + 2])
            tile = self.store.fetch(key, Tier.HOST).result()
            self._update_tile(t, tile, grads, steps, grad_scale)
            # Done for this step: needed again at the next one, after every tile still to come.
            self.store.set_next_use({key: len(keys)})
            self.store.release(key, Tier.HOST, dirty=True)
        self.steps = steps
        return StepResult(True, norm, clip)

    def _update_tile(self, t: int, tile: torch.Tensor, grads: list[torch.Tensor | None],
                     steps: list[int], grad_scale: float) -> None:
        for s in self.tiles[t]:
            grad = grads[s.param]
            if grad is None:
                continue
            p = self.params[s.param]
            part = slice(s.param_offset, s.param_offset + s.numel)
            cols = slice(s.tile_offset, s.tile_offset + s.numel)
            master, out = tile[0, cols], p.data.view(-1)[part]
            adam_step(master, grad.view(-1)[part], tile[1, cols], tile[2, cols], step=steps[s.param],
                      lr=self.lr, beta1=self.betas[0], beta2=self.betas[1], eps=self.eps,
                      weight_decay=self.weight_decay, adamw=self.adamw_mode, grad_scale=grad_scale,
                      out_lowp=None if p.dtype == torch.float32 else out, threads=self.threads)
            if p.dtype == torch.float32:
                out.copy_(master)

    # -- state, streamed ------------------------------------------------------------------------

    def iter_state(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield (param index, {"step", "master", "exp_avg", "exp_avg_sq"}) one parameter at a
        time: memory holds one parameter's state and one tile, whatever the model size."""
        by_param: dict[int, list[tuple[int, Segment]]] = {}
        for t, segments in enumerate(self.tiles):
            for s in segments:
                by_param.setdefault(s.param, []).append((t, s))
        for i, p in enumerate(self.params):
            state = {name: torch.empty(p.shape, dtype=torch.float32) for name in _STATE_NAMES}
            for t, s in by_param.get(i, []):
                tile = self.store.fetch(self._key(t), Tier.HOST).result()
                for row, name in enumerate(_STATE_NAMES):
                    state[name].view(-1)[s.param_offset:s.param_offset + s.numel] = \
                        tile[row, s.tile_offset:s.tile_offset + s.numel]
                self.store.release(self._key(t), Tier.HOST)
            yield i, {"step": self.steps[i], **state}

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
        """torch.optim.AdamW's format (state by parameter index plus one param group).

        Materialises every moment in RAM: for large models use iter_state()."""
        state = {i: {"step": torch.tensor(float(s["step"])), "exp_avg": s["exp_avg"],
                     "exp_avg_sq": s["exp_avg_sq"]} for i, s in self.iter_state() if s["step"]}
        group = {"lr": self.lr, "betas": self.betas, "eps": self.eps,
                 "weight_decay": self.weight_decay, "amsgrad": False, "maximize": False,
                 "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                 "decoupled_weight_decay": self.adamw_mode, "params": list(range(len(self.params)))}
        return {"state": state, "param_groups": [group]}

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
