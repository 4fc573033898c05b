"""What the compressed-state kernel refuses: Python names the culprit, C returns -EINVAL for
what slipped past, and a refused call writes nothing."""

from types import FunctionType

import pytest
import torch

from infinity.optim import SegmentState, StateFormat, StateKernel
from infinity.optim._native import ffi, lib

HYPER = {"step": 1, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
         "weight_decay": 0.0, "adamw": True}
EINVAL = -22


def _segment(fmt: StateFormat, n: int = 200) -> tuple[SegmentState, torch.Tensor, torch.Tensor]:
    """(state, grad, bf16 values) of a fresh segment of fmt, with a master row if fmt has one."""
    layout = fmt.layout(n, torch.bfloat16)
    views = layout.views(torch.zeros(layout.nbytes, dtype=torch.uint8))
    values = torch.randn(n).to(torch.bfloat16)
    if "master" in views:
        views["master"].copy_(values.float())
    return layout.segment(views, 0, n), torch.randn(n), values


def _refused(exc: type[Exception], match: str, fmt: StateFormat, state: SegmentState,
             grad: object, values: torch.Tensor | None, **kw: object) -> None:
    """The call raises and leaves every tensor as it was."""
    tensors = [t for t in (*state, values) if isinstance(t, torch.Tensor)]
    before = [t.clone() for t in tensors]
    with pytest.raises(exc, match=match):
        StateKernel(fmt, **HYPER)(state, grad, values, **kw)
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t, b), "a refused call modified its tensors"


def test_bad_formats_are_named():
    with pytest.raises(ValueError, match="moments='int4' is not one of"):
        StateFormat("int4")
    with pytest.raises(ValueError, match="master='bf16' is not one of"):
        StateFormat(master="bf16")
    for block in (0, 32, 100, 8192, 256.0, True):
        with pytest.raises(ValueError, match="block=.* must be a multiple of 64 in"):
            StateFormat("int8", block=block)
    with pytest.raises(TypeError, match="state_format must be a StateFormat"):
        StateKernel("int8", **HYPER)
    with pytest.raises(ValueError, match="seed must be an int in"):
        StateKernel(StateFormat(), seed=-1, **HYPER)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        StateKernel(StateFormat("int8"), **{**HYPER, "beta2": 1.0})


def test_wrong_tensors_are_named_and_nothing_changes():
    fmt = StateFormat("int8", "fp32", block=64)
    state, grad, values = _segment(fmt)
    _refused(TypeError, "exp_avg has dtype torch.float32; expected torch.uint8", fmt,
             state._replace(exp_avg=torch.zeros(200)), grad, values)
    _refused(ValueError, "exp_avg_sq has 199 elements, expected 200", fmt,
             state._replace(exp_avg_sq=state.exp_avg_sq[:199]), grad, values)
    _refused(ValueError, "exp_avg_scale has 3 elements, expected 4", fmt,
             state._replace(exp_avg_scale=state.exp_avg_scale[:3]), grad, values)
    _refused(TypeError, "exp_avg_sq_scale must be a torch.Tensor, got NoneType", fmt,
             state._replace(exp_avg_sq_scale=None), grad, values)
    _refused(ValueError, "master has 100 elements", fmt,
             state._replace(master=state.master[:100]), grad, values)
    _refused(ValueError, "grad holds 199 elements, the segment 200", fmt, state,
             [grad[:99], grad[99:198], grad[198:199]], values)
    _refused(TypeError, "grad piece 1 has dtype torch.int32", fmt, state,
             [grad[:100], grad[100:].int()], values)
    _refused(ValueError, "grad piece 0 is not contiguous", fmt, state, torch.randn(400)[::2],
             values)
    _refused(ValueError, "values has 201 elements", fmt, state, grad,
             torch.zeros(201, dtype=torch.bfloat16))
    _refused(ValueError, "values and grad piece 0 share memory|grad piece 0 and values share",
             fmt, state, values.view(torch.int16).view(torch.bfloat16), values)


def test_a_master_format_needs_its_master_and_a_free_one_its_values():
    fmt = StateFormat("bf16", "fp32")
    state, grad, values = _segment(fmt)
    _refused(ValueError, "the format keeps an fp32 master", fmt, state._replace(master=None),
             grad, values)
    free = StateFormat("bf16", "none")
    state, grad, values = _segment(free)
    _refused(ValueError, "the 16-bit values are the parameters: pass them as values", free,
             state, grad, None)
    _refused(TypeError, "values has dtype torch.float32", free, state, grad, values.float())
    _refused(ValueError, "exp_avg_scale is given but moments are 'bf16'", free,
             state._replace(exp_avg_scale=torch.zeros(4)), grad, values)


def test_index_must_leave_room_for_the_segment():
    fmt = StateFormat("int8", "none")
    state, grad, values = _segment(fmt)
    _refused(ValueError, "index must be an int in", fmt, state, grad, values, index=-1)
    _refused(ValueError, "index must be an int in", fmt, state, grad, values, index=2**64 - 199)
    StateKernel(fmt, **HYPER)(state, grad, values, index=2**64 - 200)  # the last one that fits


def test_segments_must_keep_blocks_whole():
    fmt = StateFormat("int8", block=128)
    layout = fmt.layout(1000, torch.bfloat16)
    views = layout.views(torch.zeros(layout.nbytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"segment \[64, 256\) does not start and end on blocks"):
        layout.segment(views, 64, 256)
    with pytest.raises(ValueError, match=r"segment \[128, 200\) does not start and end"):
        layout.segment(views, 128, 200)
    assert layout.segment(views, 896, 1000).exp_avg_scale.numel() == 1  # to the tile's end
    with pytest.raises(ValueError, match=r"outside the tile's 1000 elements"):
        layout.segment(views, 0, 1001)
    with pytest.raises(ValueError, match="the tile has 10 bytes"):
        layout.views(torch.zeros(10, dtype=torch.uint8))


def _c_segment(numel: int, **kw: object) -> tuple[object, list]:
    """A valid 8-bit, master-free C segment of n elements (and what keeps its memory), with the
    fields in kw changed; a function value is called with that memory."""
    n = numel
    keep = [ffi.new("uint8_t[]", n), ffi.new("uint8_t[]", n), ffi.new("float[]", 4),
            ffi.new("float[]", 4), ffi.new("uint16_t[]", n), ffi.new("float[]", n)]
    grads = ffi.new("struct inf_adam_grad[]", [{"data": keep[5], "n": n,
                                                "dtype": lib.INF_ADAM_DTYPE_F32}])
    keep.append(grads)
    fields = {"n": n, "master": ffi.NULL, "values": keep[4],
              "values_dtype": lib.INF_ADAM_DTYPE_BF16, "moments": lib.INF_ADAM_MOMENTS_Q8,
              "exp_avg": keep[0], "exp_avg_sq": keep[1], "exp_avg_scale": keep[2],
              "exp_avg_sq_scale": keep[3], "block": 64, "grad": grads, "grad_pieces": 1,
              "seed": 0, "index": 0}
    kw = {k: v(keep) if isinstance(v, FunctionType) else v for k, v in kw.items()}
    return ffi.new("struct inf_adam_segment *", {**fields, **kw}), keep


def test_c_api_returns_einval_for_bad_segments():
    """The C contract on its own: -EINVAL, never a crash, for what Python would have caught."""
    params = ffi.new("struct inf_adam_params *", {
        "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0,
        "grad_scale": 1.0, "step": 1, "adamw": 1, "isa": 0, "threads": 1})
    seg, keep = _c_segment(200)
    assert lib.inf_adam_state_step(params, seg) == 0
    assert lib.inf_adam_state_step(ffi.NULL, seg) == EINVAL
    assert lib.inf_adam_state_step(params, ffi.NULL) == EINVAL
    master = ffi.new("float[]", 200)
    bad = [
        {"moments": 9}, {"values_dtype": lib.INF_ADAM_DTYPE_F32}, {"values": ffi.NULL},
        {"values_dtype": lib.INF_ADAM_DTYPE_NONE},  # no master and nothing to update
        {"master": master, "moments": lib.INF_ADAM_MOMENTS_F32,
         "exp_avg_scale": ffi.NULL, "exp_avg_sq_scale": ffi.NULL},  # inf_adam_step's format
        {"block": 32}, {"block": 100}, {"block": 8192}, {"exp_avg_scale": ffi.NULL},
        {"exp_avg_sq": lambda keep: keep[0] + 100},  # overlaps exp_avg
        {"values": lambda keep: ffi.cast("char *", keep[4]) + 1},  # misaligned
        {"grad_pieces": 0}, {"grad": ffi.NULL}, {"n": 201}, {"index": 2**64 - 100},
        {"moments": lib.INF_ADAM_MOMENTS_BF16},  # bf16 moments with scales given
    ]
    for kw in bad:
        seg_bad, _ = _c_segment(200, **kw)
        assert lib.inf_adam_state_step(params, seg_bad) == EINVAL, kw
    short = ffi.new("struct inf_adam_grad[]", [{"data": keep[5], "n": 100,
                                                "dtype": lib.INF_ADAM_DTYPE_F32}])
    seg_bad, _ = _c_segment(200, grad=short)
    assert lib.inf_adam_state_step(params, seg_bad) == EINVAL  # pieces short of n
    seg_bad, _ = _c_segment(200, grad=lambda keep: ffi.new("struct inf_adam_grad[]", [
        {"data": keep[4], "n": 200, "dtype": lib.INF_ADAM_DTYPE_BF16}]))
    assert lib.inf_adam_state_step(params, seg_bad) == EINVAL  # grad overlaps values
    empty, _ = _c_segment(0, exp_avg=ffi.NULL, exp_avg_sq=ffi.NULL, grad=ffi.NULL,
                          grad_pieces=0)
    assert lib.inf_adam_state_step(params, empty) == 0
