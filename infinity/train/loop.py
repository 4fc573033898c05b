"""The training loop: micro-batches through the engine, one record of figures per optimizer
step, and a graceful stop on Ctrl-C (the step in progress finishes first)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from infinity.engine import Engine
from infinity.memory import rss_bytes

logger = logging.getLogger(__name__)

NVME_DIRECTIONS = ("host->nvme", "nvme->host")


@dataclass
class StepRecord:
    """Figures of one optimizer step (bytes; GB/s are decimal, 1e9 bytes per second)."""

    step: int
    loss: float  # mean over the step's micro-batches
    tokens: int
    step_s: float
    tokens_per_s: float
    rss_bytes: int  # resident host memory after the step
    nvme_gbps: float  # bytes moved to and from NVMe during the step / step time
    lr: float
    elapsed_s: float  # since the first step began
    clock_s: float  # time.perf_counter() when the step ended (lines it up with the engine trace)
    tier_used_bytes: dict[str, int] = field(default_factory=dict)
    moved_bytes: dict[str, int] = field(default_factory=dict)  # per direction, since the start

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class GracefulStop:
    """While active, the first SIGINT asks the loop to stop after the current step; a second
    one interrupts at once (KeyboardInterrupt). Outside the main thread it does nothing."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        logger.warning("interrupted: stopping after this step (press Ctrl-C again to abort)")

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _moved(stats: dict[str, Any]) -> dict[str, int]:
    return {direction: int(m["nbytes"]) for direction, m in stats["store"]["moves"].items()}


def train(engine: Engine, batches: Iterator[torch.Tensor], *, steps: int,
          on_step: Callable[[StepRecord], None] = lambda record: None,
          stop: GracefulStop | None = None, first_step: int = 1) -> list[StepRecord]:
    """Run optimizer steps `first_step`..`steps` (gradient_accumulation_steps micro-batches
    each) of causal-LM training on token rows from `batches`; `on_step` gets each step's
    record. Stops early, after a whole step, when `stop.requested` becomes true."""
    accumulation = engine.config.gradient_accumulation_steps
    records: list[StepRecord] = []
    engine.train()
    moved = _moved(engine.stats())
    start = time.perf_counter()
    for step in range(first_step, steps + 1):
        t0 = time.perf_counter()
        lr = engine.get_lr()[0]
        losses, tokens = [], 0
        for _ in range(accumulation):
            ids = next(batches)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            tokens += ids.numel()
        step_s = time.perf_counter() - t0
        stats = engine.stats()
        now = _moved(stats)
        nvme = sum(now.get(d, 0) - moved.get(d, 0) for d in NVME_DIRECTIONS)
        moved = now
        record = StepRecord(
            step=step, loss=sum(losses) / len(losses), tokens=tokens, step_s=step_s,
            tokens_per_s=tokens / step_s, rss_bytes=rss_bytes(), nvme_gbps=nvme / step_s / 1e9, lr=lr,
            elapsed_s=t0 + step_s - start, clock_s=t0 + step_s,
            tier_used_bytes={t: s.used_nbytes for t, s in stats["store"]["tiers"].items()},
            moved_bytes=now)
        records.append(record)
        on_step(record)
        if stop is not None and stop.requested:
            logger.warning("stopped after step %d of %d", step, steps)
            break
    return records
