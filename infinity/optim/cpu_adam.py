"""`CPUAdam`: a drop-in for `torch.optim.AdamW` / `torch.optim.Adam` on CPU float32 tensors.

Each parameter is updated by one pass of the native kernel (see `infinity.optim._native`), which
runs the same formula as torch's CPU single-tensor Adam, so results match torch to float rounding
(bit for bit except where torch's vectorized sqrt is an ulp off). State and param groups use
torch's keys, so `state_dict()` loads into torch's Adam/AdamW and torch's into `CPUAdam`.
"""

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from infinity.memory import ThreadPool
from infinity.optim._native import adam_step, check_hyperparameters, check_threads, resolve_isa

logger = logging.getLogger(__name__)

# Group keys torch's Adam stores that select features this kernel does not have; a group with
# any of them set (for example from a loaded torch state_dict) is refused rather than ignored.
_UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")


def _scalar_dtype() -> torch.dtype:
    """The dtype torch's Adam uses for state["step"], so state dicts move both ways unchanged."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class CPUAdam(torch.optim.Optimizer):
    """Adam / AdamW over CPU float32 parameters with a fused, multi-threaded SIMD kernel.

    Parameters
    ----------
    params:
        Parameters or param groups, as for any torch optimizer. Each must be a contiguous float32
        CPU tensor; its gradient must have the same shape and dtype.
    lr, betas, eps, weight_decay:
        As in torch.optim.AdamW. The default weight_decay is 0 (torch's AdamW defaults to 1e-2).
    adamw_mode:
        True: decoupled weight decay (AdamW); False: L2 decay added to the gradient (Adam).
        Stored per group under torch's key `decoupled_weight_decay`.
    threads:
        Most threads per parameter update (default: all cores this process may use), started
        once with the optimizer and reused by every update. Results do not depend on it.

    Notes
    -----
    The group keys `foreach` and `fused` are kept only so state dicts round-trip with torch; they
    choose between torch's kernels and mean nothing here. Groups with amsgrad, maximize,
    capturable or differentiable set are refused in `step`.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True, *,
                 threads: int | None = None) -> None:
        check_hyperparameters(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                              weight_decay=weight_decay)
        check_threads(threads)
        defaults = {
            "lr": lr, "betas": (float(betas[0]), float(betas[1])), "eps": eps,
            "weight_decay": weight_decay, "amsgrad": False, "maximize": False,
            "foreach": None, "capturable": False, "differentiable": False, "fused": None,
            "decoupled_weight_decay": bool(adamw_mode),
        }
        super().__init__(params, defaults)
        # - Kernel workers, made once: starting threads on every parameter costs ~40 us each.
        self._pool = ThreadPool(check_threads(threads))
        logger.debug("CPUAdam kernel runs %s", resolve_isa("auto"))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Update every parameter that has a gradient; returns the closure's loss, if any.

        Raises ValueError or TypeError naming the group and parameter whose tensor, gradient or
        state the kernel cannot update in place (see `infinity.optim._native.adam_step`).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            for key in _UNSUPPORTED:
                if group.get(key):
                    raise ValueError(f"param_groups[{gi}][{key!r}] is {group[key]!r}; CPUAdam "
                                     f"does not implement {key}, use torch.optim.Adam for it")
            for pi, p in enumerate(group["params"]):
                if p.grad is not None:
                    self._step_param(p, group, f"param_groups[{gi}]['params'][{pi}]")
        return loss

    def _step_param(self, p: torch.Tensor, group: dict[str, Any], where: str) -> None:
        """Create state on first use (as torch does), advance the step count, run the kernel."""
        if p.grad.is_sparse:
            raise ValueError(f"{where} has a sparse gradient; CPUAdam needs dense gradients")
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        try:
            adam_step(
                p, p.grad, state["exp_avg"], state["exp_avg_sq"], step=int(state["step"].item()),
                lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                adamw=bool(group["decoupled_weight_decay"]), pool=self._pool,
            )
        except (TypeError, ValueError) as exc:
            state["step"] -= 1
            raise type(exc)(f"{where} (shape {tuple(p.shape)}): {exc}") from exc
