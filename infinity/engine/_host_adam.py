"""Per-unit Adam with its state in ordinary host tensors: the optimizer when nothing is offloaded.

Same verbs as the swapped optimizer's per-unit entry point (`begin_step`, `step_unit`,
`finish_step`, `lr`), so the engine drives both alike. The unit's values stay in the store: a
float32 unit's values entry is the master; a low-precision unit keeps an fp32 master here and
the kernel writes the rounded value into the entry in the same pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infinity.optim import adam_step
from infinity.store import TensorStore, Tier
from infinity.zero import FetchUnit


class HostUnitAdam:
    """Adam / AdamW over fetch units, state in host RAM (12 or 8 bytes per element)."""

    def __init__(self, units: Sequence[FetchUnit], store: TensorStore, *, lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float, adamw_mode: bool, threads: int | None = None) -> None:
        self.units = list(units)
        self.store = store
        self.lr, self.betas, self.eps = lr, betas, eps
        self.weight_decay, self.adamw_mode, self.threads = weight_decay, adamw_mode, threads
        self._moments = [(torch.zeros(u.numel), torch.zeros(u.numel)) for u in self.units]
        self._masters = [self._initial_master(u) for u in self.units]
        self._completed = 0
        self._stepped: set[int] = set()

    def _initial_master(self, unit: FetchUnit) -> torch.Tensor | None:
        if unit.dtype == torch.float32:
            return None
        values = self.store.fetch(unit.key, Tier.HOST).result()
        try:
            return values.to(torch.float32)
        finally:
            self.store.release(unit.key, Tier.HOST)

    @property
    def completed_steps(self) -> int:
        return self._completed

    def begin_step(self) -> int:
        return self._completed + 1

    def step_unit(self, u: int, grad: torch.Tensor, *, grad_scale: float = 1.0) -> None:
        """Update unit `u` from its flat gradient (multiplied by grad_scale in the kernel)."""
        if u in self._stepped:
            return
        unit = self.units[u]
        values = self.store.fetch(unit.key, Tier.HOST).result()
        try:
            master = self._masters[u]
            exp_avg, exp_avg_sq = self._moments[u]
            adam_step(values if master is None else master, grad, exp_avg, exp_avg_sq,
                      step=self._completed + 1, lr=self.lr, beta1=self.betas[0], beta2=self.betas[1],
                      eps=self.eps, weight_decay=self.weight_decay, adamw=self.adamw_mode,
                      grad_scale=grad_scale, out_lowp=None if master is None else values,
                      threads=self.threads)
        finally:
            self.store.release(unit.key, Tier.HOST, dirty=True)
        self._stepped.add(u)

    def finish_step(self) -> None:
        missing = sorted(set(range(len(self.units))) - self._stepped)
        if missing:
            raise ValueError(f"finish_step: units {missing} were not stepped")
        self._stepped.clear()
        self._completed += 1
