"""`cpu_checkpointing`: the inputs saved at a recompute boundary wait in host memory.

[Note: host copies of recompute inputs] A recomputed function keeps only its inputs between
forward and backward; on an accelerator those are the activations that still occupy its
memory. Under `cpu_checkpointing` torch's checkpoint is the reentrant kind, whose inputs are
saved with `save_for_backward` and so pass through autograd's saved-tensor hooks: `pack` copies an
accelerator tensor into pinned host memory (asynchronously, on the current stream) and drops
the device copy; `unpack` copies it back when backward recomputes the function. Gradients never
cross to the host. Tensors already on the host are kept as they are.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class HostCopy(NamedTuple):
    """A saved tensor parked in host memory, and the device it comes back to."""

    host: torch.Tensor
    device: torch.device


class HostOffload:
    """Saved-tensor hooks that keep `compute`-device tensors in host memory.

    Args:
        compute: the device whose tensors are moved out (tensors elsewhere stay as they are).
        pin: copy into pinned memory, asynchronously (an accelerator); False copies
            synchronously into ordinary memory.
    """

    def __init__(self, compute: torch.device, *, pin: bool) -> None:
        self.compute = compute
        self.pin = pin
        self.parked_bytes = 0  # bytes copied to the host since this object was made

    def pack(self, t: torch.Tensor) -> torch.Tensor | HostCopy:
        if t.device != self.compute:
            return t
        host = torch.empty(t.size(), dtype=t.dtype, device="cpu", pin_memory=self.pin)
        host.copy_(t, non_blocking=self.pin)
        self.parked_bytes += host.numel() * host.element_size()
        return HostCopy(host, t.device)

    def unpack(self, saved: torch.Tensor | HostCopy) -> torch.Tensor:
        if isinstance(saved, HostCopy):
            return saved.host.to(saved.device, non_blocking=self.pin)
        return saved

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context manager that installs `pack` / `unpack`."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def accelerator_of(args: tuple) -> torch.device | None:
    """The first non-CPU device among the tensor arguments, if any."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type != "cpu":
            return a.device
    return None
