"""`run(function, *args)`: activation recomputation (DeepSpeed's `checkpointing.checkpoint`).

Forward runs `function` without keeping its intermediate activations; backward runs it again
(with the same RNG state) to get them. Under the engine the recompute is an ordinary forward:
its modules' hooks fetch their parameters again, the recompute is part of the recorded trace,
and from step 2 those fetches are prefetched like any other (docs/engine.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from infinity.recompute import _settings
from infinity.recompute._host import HostOffload, accelerator_of


def run(function: Callable[..., Any], *args: Any, use_reentrant: bool = False) -> Any:
    """Run `function(*args)` keeping only `args` for backward; recompute the rest in backward.

    The settings come from `configure` (or the engine's `activation_checkpointing` section):
    `cpu_checkpointing` keeps the accelerator tensors among `args` in pinned host memory until
    backward; `synchronize_checkpoint_boundary` synchronises the accelerator around each run of
    `function`; `profile` times each run (`timings()`). `use_reentrant` picks torch's reentrant
    checkpoint (DeepSpeed's kind); the default, non-reentrant, also gives parameter gradients
    when no argument requires grad. Under `cpu_checkpointing` the reentrant kind is used.
    """
    settings = _settings.settings()
    device = accelerator_of(args)
    offload = (HostOffload(device, pin=True) if settings.cpu_checkpointing and device is not None
               else None)
    sync = settings.synchronize_checkpoint_boundary and device is not None and device.type == "cuda"
    timed = _with_boundaries(function, sync=sync, profile=settings.profile)
    return run_with(timed, args, use_reentrant=use_reentrant, offload=offload)


def run_with(function: Callable[..., Any], args: tuple, *, use_reentrant: bool,
             offload: HostOffload | None) -> Any:
    """torch's checkpoint of `function(*args)`; with `offload`, reentrant with the saved
    inputs in host memory. See [Note: host copies of recompute inputs]."""
    if offload is None:
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant)
    # The reentrant kind only enters backward through inputs that require grad: an empty one
    # that always does keeps the parameters' gradients when no real input requires grad.
    anchor = torch.empty(0, requires_grad=True)
    with offload.hooks():
        return torch_checkpoint.checkpoint(lambda _anchor, *a: function(*a), anchor, *args,
                                           use_reentrant=True)


def _with_boundaries(function: Callable[..., Any], *, sync: bool,
                     profile: bool) -> Callable[..., Any]:
    """`function`, synchronising the accelerator around it and timing it as configured; its
    first run is the forward, later ones are recomputes."""
    if not sync and not profile:
        return function
    runs = 0

    def bounded(*args: Any) -> Any:
        nonlocal runs
        recompute, runs = runs > 0, runs + 1
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:  # a non-reentrant recompute stops by raising once it has what backward needs
            return function(*args)
        finally:
            if sync:
                torch.cuda.synchronize()
            if profile:
                _settings.record(recompute=recompute, seconds=time.perf_counter() - start)

    return bounded
