"""The one module that calls the native CPU Adam kernel (csrc/adam, built by csrc/build_adam.py).

Everything that reaches C is checked here first, so a wrong tensor fails with an exception that
names it instead of an errno. The kernel updates the caller's memory in place; a tensor that
would need a temporary copy (non-contiguous, wrong dtype, not on the CPU) is refused, never
copied, because an update written into a copy would be silently lost.

Thread safety: `adam_step` releases the GIL while the kernel runs (cffi does this for every call),
so several Python threads may step disjoint tensors at once.
"""

import errno
import math
import os
from collections.abc import Sequence

import torch
from torch.autograd.graph import increment_version

from infinity.memory import ThreadPool, usable_cores
from infinity.optim._format import SegmentState, StateFormat
from infinity.optim._quant import block_count

try:
    from infinity.optim._adam_cffi import ffi, lib
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(
        "the CPU Adam kernel infinity.optim._adam_cffi is not built; run "
        "`python csrc/build_adam.py` from the repository root, or `pip install -e .`"
    ) from exc

# The kernel gives each thread at least this many elements (INF_ADAM__MIN_PER_THREAD in adam.c).
MIN_NUMEL_PER_THREAD = 65536

ISAS: dict[str, int] = {
    "auto": lib.INF_ADAM_ISA_AUTO,
    "scalar": lib.INF_ADAM_ISA_SCALAR,
    "avx2": lib.INF_ADAM_ISA_AVX2,
    "avx512": lib.INF_ADAM_ISA_AVX512,
}
_ISA_NAMES = {code: name for name, code in ISAS.items()}

GRAD_DTYPES: dict[torch.dtype, int] = {
    torch.float32: lib.INF_ADAM_DTYPE_F32,
    torch.bfloat16: lib.INF_ADAM_DTYPE_BF16,
    torch.float16: lib.INF_ADAM_DTYPE_F16,
}
LOWP_DTYPES: dict[torch.dtype, int] = {
    torch.bfloat16: lib.INF_ADAM_DTYPE_BF16,
    torch.float16: lib.INF_ADAM_DTYPE_F16,
}


def _check(ret: int, op: str) -> int:
    """Turn the kernel's -errno into an OSError; Python-side checks make this a bug, not misuse."""
    if ret < 0:
        raise OSError(-ret, f"{op}: {os.strerror(-ret)}")
    return ret


def resolve_isa(isa: str = "auto") -> str:
    """The instruction set the kernel runs for `isa` ("auto" -> the best this CPU has).

    Raises ValueError for an unknown name or one this CPU cannot run.
    """
    if isa not in ISAS:
        raise ValueError(f"isa={isa!r} is not one of {sorted(ISAS)}")
    ret = lib.inf_adam_isa_resolve(ISAS[isa])
    if ret < 0:
        best = _ISA_NAMES[lib.inf_adam_isa_resolve(ISAS["auto"])]
        raise ValueError(f"isa={isa!r} is not supported by this CPU; the best it has is {best!r}")
    return _ISA_NAMES[ret]


def available_isas() -> list[str]:
    """Concrete instruction sets this CPU can run, slowest first (tests force each one)."""
    return [name for name, code in ISAS.items()
            if name != "auto" and lib.inf_adam_isa_resolve(code) >= 0]


def sum_squares(t: torch.Tensor, *, isa: str = "auto") -> float:
    """The sum of squares of t's elements (float32, bf16 or fp16, on the CPU, contiguous),
    each squared exactly in double and summed in a fixed order: the same bits on every
    instruction set and thread, finite exactly when every element is (csrc/adam/inf_adam.h
    `inf_adam_sum_squares`). One pass over t's own bytes, on the calling thread."""
    if isa not in ISAS:
        raise ValueError(f"isa={isa!r} is not one of {sorted(ISAS)}")
    if isinstance(t, torch.Tensor) and t.device.type != "cpu":
        raise ValueError(f"sum_squares reads host memory; the tensor is on {t.device}")
    t = _check_tensor("t", t, tuple(GRAD_DTYPES), None)
    out = ffi.new("double *")
    _check(lib.inf_adam_sum_squares(_ptr(t), GRAD_DTYPES[t.dtype], t.numel(), ISAS[isa], out),
           "inf_adam_sum_squares")
    return out[0]


def _check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...], shape: torch.Size | None,
                  ) -> torch.Tensor:
    """Refuse anything the kernel could only update through a copy; messages name the tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on device {t.device}; the CPU Adam kernel updates host "
                         f"memory in place, so keep optimizer tensors on the CPU")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; expected {allowed}")
    if t.is_sparse or t.layout != torch.strided:
        raise ValueError(f"{name} has layout {t.layout}; only dense (strided) tensors work")
    if shape is not None and t.shape != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)} but param has {tuple(shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous ({t.stride()=}); the kernel updates memory "
                         f"in place and never through a temporary copy")
    if t.numel() and t.data_ptr() % t.element_size():
        raise ValueError(f"{name} data pointer {t.data_ptr():#x} is not aligned to its "
                         f"{t.element_size()}-byte elements")
    return t


def _check_disjoint(named: dict[str, torch.Tensor]) -> None:
    """Refuse aliasing: an update read through one name and written through another is garbage."""
    spans = [(name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
             for name, t in named.items() if t.numel()]
    for i, (name_a, lo_a, hi_a) in enumerate(spans):
        for name_b, lo_b, hi_b in spans[:i]:
            if lo_a < hi_b and lo_b < hi_a:
                raise ValueError(f"{name_a} and {name_b} share memory; each must be its own buffer")


def check_hyperparameters(*, lr: float, beta1: float, beta2: float, eps: float,
                          weight_decay: float) -> None:
    """Raise ValueError, worded as torch.optim.Adam words it, for a value outside its range."""
    if not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {beta1}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {beta2}")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def check_threads(threads: int | None) -> int:
    """The thread count to use: `threads` if it is an int >= 1, all usable cores for None."""
    if threads is None:
        return usable_cores()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1 or None, got {threads!r}")
    return threads


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float, adamw: bool, grad_scale: float = 1.0,
              out_lowp: torch.Tensor | None = None, threads: int | None = None,
              pool: ThreadPool | None = None, isa: str = "auto") -> None:
    """One Adam (adamw=False, L2 decay) or AdamW step over one tensor, in place, in one pass.

    Parameters
    ----------
    param, exp_avg, exp_avg_sq:
        float32 CPU tensors of one shape, contiguous, updated in place.
    grad:
        Same shape; float32, bfloat16 or float16. Only read.
    step:
        The number of this step, counting from 1 (torch's state["step"] after its increment).
    grad_scale:
        Multiplies the gradient before anything else: 1 / loss_scale times the clip factor.
    out_lowp:
        Optional bfloat16 / float16 tensor of param's shape that receives the new param, rounded
        to nearest even (equal to `param.to(out_lowp.dtype)`).
    threads, pool:
        The kernel runs on the calling thread and on workers of `pool`, at most `threads` in all
        (default: the pool's size; small tensors use fewer). Without a pool, a pool of `threads`
        (default: every core this process may use) is made for this call alone: callers that
        step many tensors keep one (`infinity.memory.ThreadPool`). Results depend on neither.
    isa:
        "auto", "scalar", "avx2" or "avx512"; results do not depend on it.

    Raises TypeError for a wrong type or dtype, ValueError for a wrong device, shape, layout,
    alignment, aliasing or hyperparameter; every message names the tensor or value at fault.
    """
    _check_tensor("param", param, (torch.float32,), None)
    shape = param.shape
    named = {
        "param": param,
        "grad": _check_tensor("grad", grad, tuple(GRAD_DTYPES), shape),
        "exp_avg": _check_tensor("exp_avg", exp_avg, (torch.float32,), shape),
        "exp_avg_sq": _check_tensor("exp_avg_sq", exp_avg_sq, (torch.float32,), shape),
    }
    if out_lowp is not None:
        named["out_lowp"] = _check_tensor("out_lowp", out_lowp, tuple(LOWP_DTYPES), shape)
    _check_disjoint(named)
    hyper = {"step": step, "lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps,
             "weight_decay": weight_decay, "adamw": adamw, "grad_scale": grad_scale, "isa": isa}
    threads = check_threads(pool.threads if threads is None and pool is not None else threads)
    if pool is None and threads > 1 and param.numel() >= 2 * MIN_NUMEL_PER_THREAD:
        with ThreadPool(threads) as own:
            AdamKernel(**hyper, pool=own)(param, grad, exp_avg, exp_avg_sq, out_lowp)
    else:
        AdamKernel(**hyper, threads=threads, pool=pool)(param, grad, exp_avg, exp_avg_sq, out_lowp)
    # The kernel wrote behind autograd's back; bump versions as an in-place torch op would, so a
    # graph that saved one of these tensors fails loudly instead of using the new values.
    for name, t in named.items():
        if name != "grad":
            increment_version(t)


class AdamKernel:
    """One step's hyperparameters, checked and packed once, for a caller that makes many kernel
    calls per step (SwappedOptimizer: one per tile segment; ~40 us of checks per call is ~3% of
    a 294M model's step). A call checks nothing of its tensors in Python: the caller guarantees
    what `adam_step` checks (CPU, dtypes, contiguous, equal numel) and bumps autograd versions
    where a graph could have saved one of them; the C side still refuses NULL, misaligned and
    overlapping arrays. Arguments as `adam_step`'s; `pool` is kept alive by the kernel."""

    def __init__(self, *, step: int, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, adamw: bool, grad_scale: float = 1.0,
                 threads: int | None = None, pool: ThreadPool | None = None,
                 isa: str = "auto") -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"step must be an int >= 1 (the step being taken), got {step!r}")
        check_hyperparameters(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
        if not math.isfinite(grad_scale):
            raise ValueError(f"grad_scale must be finite, got {grad_scale}; "
                             "skip the step on overflow")
        threads = check_threads(pool.threads if threads is None and pool is not None else threads)
        resolve_isa(isa)
        self._pool = pool
        self._params = ffi.new("struct inf_adam_params *", {
            "lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay,
            "grad_scale": grad_scale, "step": step, "adamw": int(bool(adamw)), "isa": ISAS[isa],
            "threads": threads,
            "pool": ffi.NULL if pool is None else ffi.cast("struct inf_pool *", pool.address),
        })

    def __call__(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, out_lowp: torch.Tensor | None = None) -> None:
        """Update param, exp_avg, exp_avg_sq (and out_lowp) in place from grad."""
        _check(lib.inf_adam_step(
            self._params, ffi.cast("float *", param.data_ptr()),
            ffi.cast("void *", grad.data_ptr()),
            GRAD_DTYPES[grad.dtype], ffi.cast("float *", exp_avg.data_ptr()),
            ffi.cast("float *", exp_avg_sq.data_ptr()),
            ffi.NULL if out_lowp is None else ffi.cast("void *", out_lowp.data_ptr()),
            lib.INF_ADAM_DTYPE_NONE if out_lowp is None else LOWP_DTYPES[out_lowp.dtype],
            param.numel(),
        ), "inf_adam_step")


_MOMENTS = {"fp32": lib.INF_ADAM_MOMENTS_F32, "bf16": lib.INF_ADAM_MOMENTS_BF16,
            "int8": lib.INF_ADAM_MOMENTS_Q8}
_UINT64 = 1 << 64


_VOID_P, _FLOAT_P = ffi.typeof("void *"), ffi.typeof("float *")
_GRAD_ARRAY = ffi.typeof("struct inf_adam_grad[]")
_SEGMENT_P = ffi.typeof("struct inf_adam_segment *")


def _ptr(t: torch.Tensor | None, ctype: object = _VOID_P) -> object:
    return ffi.NULL if t is None else ffi.cast(ctype, t.data_ptr())


class StateKernel:
    """One step's Adam / AdamW over tile segments whose state is in a `StateFormat`: the fused
    native pass of csrc/adam/inf_adam.h `inf_adam_state_step` (decode, update, re-code, write
    the parameters), or `AdamKernel` for fp32 moments with a master (today's kernel, bit for
    bit). Hyperparameters as `adam_step`'s, checked and packed once.

    seed:
        The stochastic rounding stream of parameters without a master: with the step number
        and each element's index it decides every rounding, so a run resumed from a checkpoint
        (same seed, steps and indices) is bit-identical. Tiling, threads and ISA never matter.

    A call checks what memory safety needs in Python (types, dtypes, device, contiguity,
    element counts: a few microseconds) and leaves alignment and aliasing to the C side, whose
    refusal is then explained by name. Like `AdamKernel` it leaves autograd versions to the
    caller."""

    def __init__(self, state_format: StateFormat, *, step: int, lr: float, beta1: float,
                 beta2: float, eps: float, weight_decay: float, adamw: bool,
                 grad_scale: float = 1.0, seed: int = 0, threads: int | None = None,
                 pool: ThreadPool | None = None, isa: str = "auto") -> None:
        if not isinstance(state_format, StateFormat):
            raise TypeError("state_format must be a StateFormat, got "
                            f"{type(state_format).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _UINT64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
        self.format = state_format
        self._fp32 = AdamKernel(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                weight_decay=weight_decay, adamw=adamw, grad_scale=grad_scale,
                                threads=threads, pool=pool, isa=isa)
        self._params = self._fp32._params
        self._seed = seed

    def __call__(self, state: SegmentState, grad: torch.Tensor | Sequence[torch.Tensor],
                 values: torch.Tensor | None = None, *, index: int = 0) -> None:
        """Update one segment in place.

        state:
            Its state (`TileLayout.segment`); `state.master` is the tile's master row, the
            float32 parameters themselves, or None without a master.
        grad:
            Its gradient: one tensor, or several laid end to end (an engine unit's parameters),
            of float32, bfloat16 or float16; only read.
        values:
            The 16-bit parameters: with a master, its copy (rounded to nearest even; None: no
            copy); without one, the parameters, updated with stochastic rounding.
        index:
            Without a master: the rounding counter of the segment's first element (its index
            among all elements the run steps, so that no two elements share random bits).

        Raises TypeError / ValueError naming the tensor at fault.
        """
        pieces = [grad] if isinstance(grad, torch.Tensor) else list(grad)
        n = self._check(state, pieces, values, index)
        if state.master is not None and self.format.moments == "fp32":
            self._fp32_pieces(state, pieces, values)
            return
        grads = ffi.new(_GRAD_ARRAY, [(_ptr(g), g.numel(), GRAD_DTYPES[g.dtype]) for g in pieces])
        seg = ffi.new(_SEGMENT_P, (
            n, _ptr(state.master, _FLOAT_P), _ptr(values),
            lib.INF_ADAM_DTYPE_NONE if values is None else LOWP_DTYPES[values.dtype],
            _MOMENTS[self.format.moments], _ptr(state.exp_avg), _ptr(state.exp_avg_sq),
            _ptr(state.exp_avg_scale, _FLOAT_P), _ptr(state.exp_avg_sq_scale, _FLOAT_P),
            self.format.block, grads, len(pieces), self._seed, index))
        ret = lib.inf_adam_state_step(self._params, seg)
        if ret == -errno.EINVAL:  # what only C checks (alignment, aliasing): say which tensor
            named = {name: t for name, t in zip(_SEGMENT_NAMES, (*state, values))
                     if t is not None}
            named.update((f"grad piece {k}", g) for k, g in enumerate(pieces))
            for name, t in named.items():
                _check_tensor(name, t, (t.dtype,), None)
            _check_disjoint(named)
        _check(ret, "inf_adam_state_step")

    def _fp32_pieces(self, state: SegmentState, pieces: list[torch.Tensor],
                     values: torch.Tensor | None) -> None:
        """Today's kernel, once per gradient piece (fp32 state has no blocks to keep whole)."""
        at = 0
        for g in pieces:
            span = slice(at, at + g.numel())
            self._fp32(state.master[span], g.view(-1), state.exp_avg[span],
                       state.exp_avg_sq[span], None if values is None else values[span])
            at = span.stop

    def _check(self, state: SegmentState, pieces: list[torch.Tensor],
               values: torch.Tensor | None, index: int) -> int:
        """The segment's element count, after refusing what the kernel would misread."""
        fmt = self.format
        if not isinstance(state, SegmentState):
            raise TypeError(f"state must be a SegmentState, got {type(state).__name__}")
        moment = (fmt.moment_dtype,)
        n = _lean("exp_avg", state.exp_avg, moment, None).numel()
        _lean("exp_avg_sq", state.exp_avg_sq, moment, n)
        if state.master is not None:
            _lean("master", state.master, _F32, n)
        elif fmt.master == "fp32":
            raise ValueError("the format keeps an fp32 master (master='fp32'): state.master "
                             "must be the tile's master row or the float32 parameters")
        if values is not None:
            _lean("values", values, _LOWP, n)
        elif state.master is None:
            raise ValueError("without a master (state.master is None) the 16-bit values are "
                             "the parameters: pass them as values")
        if fmt.quantized:
            blocks = block_count(n, fmt.block)
            _lean("exp_avg_scale", state.exp_avg_scale, _F32, blocks)
            _lean("exp_avg_sq_scale", state.exp_avg_sq_scale, _F32, blocks)
        elif state.exp_avg_scale is not None or state.exp_avg_sq_scale is not None:
            raise ValueError(f"exp_avg_scale is given but moments are {fmt.moments!r}, not 'int8'")
        if not pieces:
            raise ValueError("grad must be a tensor or a non-empty list of tensors")
        total = 0
        for k, g in enumerate(pieces):
            _lean(("grad piece", k), g, _GRADS, None)
            total += g.numel()
        if total != n:
            raise ValueError(f"grad holds {total} elements, the segment {n}")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= _UINT64 - n:
            raise ValueError(f"index must be an int in [0, 2**64 - {n}], got {index!r}")
        return n


_F32 = (torch.float32,)
_LOWP = tuple(LOWP_DTYPES)
_GRADS = tuple(GRAD_DTYPES)


_SEGMENT_NAMES = (*SegmentState._fields, "values")


def _lean(name: str | tuple[str, int], t: object, dtypes: tuple[torch.dtype, ...],
          numel: int | None) -> torch.Tensor:
    """A dense contiguous CPU tensor of one of dtypes (and numel elements): the checks memory
    safety needs, in one expression; `_check_tensor` words a refusal. A (name, k) name is
    spelled "name k" only then."""
    if (not isinstance(t, torch.Tensor) or t.dtype not in dtypes or not t.is_cpu
            or t.layout != torch.strided or not t.is_contiguous()):
        if isinstance(name, tuple):
            name = f"{name[0]} {name[1]}"
        _check_tensor(name, t, dtypes, None)  # raises, naming what is wrong
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, expected {numel}")
    return t
