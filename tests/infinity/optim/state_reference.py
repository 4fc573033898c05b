"""The compressed-state Adam step in plain torch: the formula of `inf_adam_state_step`
(csrc/adam/inf_adam.h), the 8-bit codes of infinity/optim/_quant.py and the stochastic rounding
of [Note: stochastic rounding] (csrc/adam/adam_state_kernel.h), written without the kernel so a
test can demand the kernel's bits.

Every float32 operation is one IEEE operation rounded once: products, sums and differences in
float32 torch ops, divisions and square roots through float64 (exact for float32 operands, so
rounding back gives the correctly rounded float32 result whatever torch's vector code does).
"""

from __future__ import annotations

import math

import torch

from infinity.optim import StateFormat
from infinity.optim._quant import EXP_AVG_CODE, EXP_AVG_SQ_CODE, dequantize, quantize

MASK32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1
FLT_MAX = 3.4028234663852886e38


def f32(x: float) -> torch.Tensor:
    """A Python float rounded to float32 once, as C's (float) cast of a double."""
    return torch.tensor(x, dtype=torch.float64).float()


def _div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.double() / b.double()).float()


def _sqrt(a: torch.Tensor) -> torch.Tensor:
    return a.double().sqrt().float()


def _mix64(z: int) -> int:
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & MASK64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def rounding_key(seed: int, step: int) -> tuple[int, int]:
    key = _mix64(_mix64((seed + 0x9E3779B97F4A7C15) & MASK64) ^ step)
    return key & MASK32, key >> 32


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 tensors holding uint32 values, never overflowing int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def random_bits(seed: int, step: int, index: int, n: int) -> torch.Tensor:
    """The 16 random bits (in int64) of elements index .. index + n - 1 at this step."""
    key0, key1 = rounding_key(seed, step)
    j = index + torch.arange(n, dtype=torch.int64)
    key = key0 ^ _mix32((j >> 32) ^ key1)
    return _mul32((j & MASK32) ^ key, 0x9E3779B1) >> 16


def _u32(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32).to(torch.int64) & MASK32


def _as16(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int64 values in [0, 2**16) as the 16-bit floats with those bits."""
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(dtype)


def stochastic_round(p: torch.Tensor, r: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 p rounded to bf16 or fp16 with the random bits r."""
    if dtype == torch.bfloat16:
        bits = _as16((_u32(p) + r) >> 16, torch.bfloat16)
        return torch.where(p.isnan(), p.to(torch.bfloat16), bits)
    low = f32(2.0**-14)
    a = p.abs()
    small = a < low
    b = torch.where(small, a + low, a)
    cut = ((_u32(b) + (r & 0x1FFF)) & ~0x1FFF).to(torch.int32).view(torch.float32)
    t = torch.copysign(torch.where(small, cut - low, cut), p)
    return torch.where(a <= FLT_MAX, t, p).to(torch.float16)


def _moments_in(fmt: StateFormat, state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    if fmt.moments == "int8":
        return (dequantize(state["exp_avg"], state["exp_avg_scale"], fmt.block, EXP_AVG_CODE),
                dequantize(state["exp_avg_sq"], state["exp_avg_sq_scale"], fmt.block,
                           EXP_AVG_SQ_CODE))
    return state["exp_avg"].float(), state["exp_avg_sq"].float()


def _moments_out(fmt: StateFormat, m: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    if fmt.moments == "int8":
        m_codes, m_scales = quantize(m, fmt.block, EXP_AVG_CODE)
        v_codes, v_scales = quantize(v, fmt.block, EXP_AVG_SQ_CODE)
        return {"exp_avg": m_codes, "exp_avg_sq": v_codes, "exp_avg_scale": m_scales,
                "exp_avg_sq_scale": v_scales}
    return {"exp_avg": m.to(fmt.moment_dtype), "exp_avg_sq": v.to(fmt.moment_dtype)}


def reference_step(fmt: StateFormat, state: dict[str, torch.Tensor], grad: list[torch.Tensor],
                   values: torch.Tensor | None, *, step: int, lr: float, beta1: float,
                   beta2: float, eps: float, weight_decay: float, adamw: bool,
                   grad_scale: float = 1.0, seed: int = 0, index: int = 0
                   ) -> dict[str, torch.Tensor]:
    """The new state (same keys as `state`, whose "master" may be absent) and "values"."""
    g = torch.cat([piece.reshape(-1).float() for piece in grad]) * f32(grad_scale)
    master = state.get("master")
    p = master.clone() if master is not None else values.float()
    m, v = _moments_in(fmt, state)
    if not adamw and weight_decay != 0.0:
        g = g + f32(weight_decay) * p
    if adamw and weight_decay != 0.0:
        p = p * f32(1.0 - lr * weight_decay)
    m = f32(beta1) * m + f32(1.0 - beta1) * g
    v = f32(beta2) * v + (f32(1.0 - beta2) * g) * g
    d = _sqrt(v) * f32(1.0 / math.sqrt(1.0 - beta2**step)) + f32(eps)
    p = p - _div(f32(lr / (1.0 - beta1**step)) * m, d)

    out = _moments_out(fmt, m, v)
    if master is not None:
        out["master"] = p
        if values is not None:
            out["values"] = p.to(values.dtype)
    else:
        r = random_bits(seed, step, index, p.numel())
        out["values"] = stochastic_round(p, r, values.dtype)
    return out
