"""The hooks that drive the coordinator, one state object per managed module.

- root forward pre-hook: begin a pass (keyed by train/eval and grad mode) and save parameter
  views by position (see [Note: saved parameter views]; not needed when every unit is
  resident: nothing is released before the step); root forward post-hook (also on an
  error): stop that, and end the pass when no backward will follow (grad disabled);
- per module that uses units: forward pre-hook acquires them, forward post-hook (also on an
  error, e.g. a checkpoint's recompute stopping early) releases them and, when grad is on,
  puts a hook on each output tensor that acquires them again when the outputs' gradients
  arrive (the module's backward is next), as FSDP2 does; a forward recomputed during backward
  keeps its units until their gradients are final;
- per trained parameter: a post-accumulate-grad hook tells the coordinator its gradient is final.

`ModelHooks.remove()` takes every one of them off the model.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from infinity.zero.coordinator import ParamCoordinator
from infinity.zero.unit import FetchUnit


class _ModuleState:
    """The forward hooks of one module that uses fetch units, and their handles."""

    def __init__(self, module: torch.nn.Module, units: Sequence[FetchUnit], coordinator: ParamCoordinator) -> None:
        self.units = list(units)
        self.coordinator = coordinator
        self._acquired: list[bool] = []  # per call in progress: whether its acquire succeeded
        self.handles = [module.register_forward_pre_hook(self._pre_forward),
                        module.register_forward_hook(self._post_forward, always_call=True)]

    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        self._acquired.append(False)
        self.coordinator.acquire(self.units)
        self._acquired[-1] = True

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        failed = sys.exc_info()[0] is not None  # torch calls us from its except block
        if self._acquired and not self._acquired.pop():
            return  # its acquire raised (the pass is aborted at the root)
        if not failed and torch.is_grad_enabled() and self.coordinator.in_backward:
            # A forward recomputed inside backward (activation recomputation): its saved tensors
            # are used right away and are not saved by position, so keep the values until the
            # unit's gradients are final.
            self.coordinator.acquire_for_backward(self.units)
        self.coordinator.release(self.units)
        if not failed and torch.is_grad_enabled():
            self._register_pre_backward(output)
            self._register_frozen_release(args)

    def _register_frozen_release(self, args: Any) -> None:
        """Frozen units are let go once the gradients of the module's inputs exist."""
        frozen = [u for u in self.units if not u.requires_grad]
        inputs = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if frozen and inputs:
            torch.autograd.graph.register_multi_grad_hook(
                inputs, lambda grads: self.coordinator.frozen_backward_done(frozen), mode="all")

    def _register_pre_backward(self, output: Any) -> None:
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return
        fired = False

        def pre_backward(grad: torch.Tensor) -> None:
            nonlocal fired
            if not fired:  # once per call, whichever output's gradient comes first
                fired = True
                self.coordinator.acquire_for_backward(self.units)

        for t in tensors:
            t.register_hook(pre_backward)


class ModelHooks:
    """Installs every hook the coordinator needs on `model`; `remove()` takes them all off."""

    def __init__(self, model: torch.nn.Module, units: Sequence[FetchUnit],
                 uses: Mapping[torch.nn.Module, Sequence[FetchUnit]], coordinator: ParamCoordinator) -> None:
        self.coordinator = coordinator
        self._saved_views: list[torch.autograd.graph.saved_tensors_hooks] = []
        # Resident units stay bound until the step: what autograd saves of them stays valid.
        self._save_by_position = any(not u.persistent for u in units)
        self._handles: list[RemovableHandle] = [
            model.register_forward_pre_hook(self._begin_pass, prepend=True),
            model.register_forward_hook(self._end_forward, always_call=True),
        ]
        self._modules = [_ModuleState(m, us, coordinator) for m, us in uses.items()]
        for unit in units:
            if unit.requires_grad:
                for slot in unit.slots:
                    self._handles.append(slot.param.register_post_accumulate_grad_hook(
                        self._grad_hook(unit)))

    def _grad_hook(self, unit: FetchUnit):
        def grad_final(param: torch.Tensor) -> None:
            self.coordinator.grad_ready(unit)
        return grad_final

    def _begin_pass(self, module: torch.nn.Module, args: Any) -> None:
        self.coordinator.begin_pass((module.training, torch.is_grad_enabled()))
        if not self._save_by_position:
            return
        # See [Note: saved parameter views]; left in _end_forward, which runs even on an error.
        views = torch.autograd.graph.saved_tensors_hooks(self.coordinator.pack, self.coordinator.unpack)
        views.__enter__()
        self._saved_views.append(views)

    def _end_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._saved_views:
            self._saved_views.pop().__exit__(None, None, None)
        if sys.exc_info()[0] is not None:  # called from torch's except block: forward failed
            self.coordinator.abort_pass()
        elif not torch.is_grad_enabled():
            self.coordinator.end_pass()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        for state in self._modules:
            for h in state.handles:
                h.remove()
        self._handles, self._modules = [], []
