"""The training loop: micro-batches through the engine, one record of figures per optimizer
step, evaluation passes, and a graceful stop on Ctrl-C or SIGTERM (the step in progress
finishes first)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from aio.device_pauses import DevicePauses
from infinity.engine import Engine
from infinity.memory import rss_bytes
from infinity.train.data import Batch, Rows, in_order

logger = logging.getLogger(__name__)

NVME_DIRECTIONS = ("host->nvme", "nvme->host")


@dataclass
class StepRecord:
    """Figures of one optimizer step (bytes; GB/s are decimal, 1e9 bytes per second)."""

    step: int
    loss: float  # mean over the step's micro-batches
    tokens: int
    trained_tokens: int  # positions the loss counted (chat data: assistant tokens only)
    step_s: float
    tokens_per_s: float
    rss_bytes: int  # resident host memory after the step
    nvme_gbps: float  # bytes moved to and from NVMe during the step / step time
    lr: float
    elapsed_s: float  # since the first step began
    clock_s: float  # time.perf_counter() when the step ended (lines it up with the engine trace)
    tier_used_bytes: dict[str, int] = field(default_factory=dict)
    moved_bytes: dict[str, int] = field(default_factory=dict)  # per direction, since the start
    grad_norm: float | None = None  # engine.last_grad_norm (None where the step took none)
    # seconds the disk under the swap file was busy yet moved almost nothing during the step
    # ([Note: a disk that pauses] in aio/device_pauses.py); None: no NVMe tier, or no counters
    disk_paused_s: float | None = None
    eval_loss: float | None = None  # on the evaluation rows after this step, when evaluated
    eval_perplexity: float | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class GracefulStop:
    """While active, the first SIGINT or SIGTERM asks the loop to stop after the current step
    (what a scheduler or `timeout` sends is Ctrl-C here); a second one interrupts at once
    (KeyboardInterrupt). Outside the main thread it does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self.by: str | None = None  # the signal that asked: "SIGINT" or "SIGTERM"
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.by = True, signal.Signals(signum).name
        # Straight to the file descriptor: the signal may come in the middle of a write to
        # sys.stderr (the progress bar), and a second write to that stream from here raises
        # "reentrant call" (logging's handler included) and ends the run.
        with contextlib.suppress(OSError):
            os.write(2, f"\n{self.by}: stopping after this step (again to abort)\n".encode())

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def _moved(stats: dict[str, Any]) -> dict[str, int]:
    return {direction: int(m["nbytes"]) for direction, m in stats["store"]["moves"].items()}


def train(engine: Engine, batches: Iterator[Batch], *, steps: int,
          on_step: Callable[[StepRecord], None] = lambda record: None,
          stop: GracefulStop | None = None, first_step: int = 1) -> list[StepRecord]:
    """Run optimizer steps `first_step`..`steps` (gradient_accumulation_steps micro-batches
    each) of causal-LM training on batches from `batches`; `on_step` gets each step's record.
    Stops early, after a whole step, when `stop.requested` becomes true."""
    accumulation = engine.config.gradient_accumulation_steps
    records: list[StepRecord] = []
    engine.train()
    moved = _moved(engine.stats())
    start = time.perf_counter()
    for step in range(first_step, steps + 1):
        if stop is not None and stop.requested:
            logger.warning("stopped after step %d of %d", step - 1, steps)
            break
        t0 = time.perf_counter()
        lr = engine.get_lr()[0]
        losses, tokens, trained = [], 0, 0
        with DevicePauses(engine.store.nvme_directory) as pauses:
            for _ in range(accumulation):
                batch = next(batches)
                loss = engine(input_ids=batch.ids, labels=batch.labels).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                tokens += batch.ids.numel()
                trained += batch.trained_tokens
        step_s = time.perf_counter() - t0
        stats = engine.stats()
        now = _moved(stats)
        nvme = sum(now.get(d, 0) - moved.get(d, 0) for d in NVME_DIRECTIONS)
        moved = now
        record = StepRecord(
            step=step, loss=sum(losses) / len(losses), tokens=tokens, trained_tokens=trained,
            step_s=step_s, tokens_per_s=tokens / step_s, rss_bytes=rss_bytes(),
            nvme_gbps=nvme / step_s / 1e9, lr=lr, elapsed_s=t0 + step_s - start,
            clock_s=t0 + step_s,
            tier_used_bytes={t: s.used_nbytes for t, s in stats["store"]["tiers"].items()},
            moved_bytes=now, grad_norm=engine.last_grad_norm,
            disk_paused_s=pauses.result.seconds if pauses.result else None)
        records.append(record)
        on_step(record)
    return records


def evaluate(engine: Engine, rows: Rows, batch_size: int) -> tuple[float, int]:
    """(mean loss per trained token over every row, trained tokens) with the engine in eval
    mode and no gradients: forward only, no optimizer."""
    total, count = 0.0, 0
    engine.eval()
    try:
        with torch.no_grad():
            for batch in in_order(rows, batch_size):
                n = batch.trained_tokens
                if n:
                    total += float(engine(input_ids=batch.ids, labels=batch.labels).loss) * n
                    count += n
    finally:
        engine.train()
    return total / max(count, 1), count


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf
