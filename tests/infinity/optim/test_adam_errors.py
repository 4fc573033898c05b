"""What the Adam kernel refuses: every refusal names the culprit and nothing is updated."""

import pytest
import torch

from infinity.optim import adam_step, available_isas, resolve_isa
from infinity.optim._native import ffi, lib

HYPER = {"step": 1, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
         "weight_decay": 0.0, "adamw": True}


def _tensors(n: int = 33) -> dict[str, torch.Tensor]:
    return {"param": torch.randn(n), "grad": torch.randn(n), "exp_avg": torch.zeros(n),
            "exp_avg_sq": torch.zeros(n)}


def _step(t: dict[str, torch.Tensor], **kw: object) -> None:
    adam_step(t["param"], t["grad"], t["exp_avg"], t["exp_avg_sq"], **{**HYPER, **kw})


def _refused(exc: type[Exception], match: str, t: dict[str, torch.Tensor], **kw: object) -> None:
    """The call raises and leaves param and state as they were."""
    before = {k: v.clone() for k, v in t.items()
              if v.device.type == "cpu" and v.layout == torch.strided}
    with pytest.raises(exc, match=match):
        _step(t, **kw)
    for k, v in before.items():
        assert torch.equal(t[k], v), f"{k} was modified by a refused call"


def test_mismatched_shapes_name_the_tensor():
    t = _tensors()
    t["grad"] = torch.randn(32)
    _refused(ValueError, r"grad has shape \(32,\) but param has \(33,\)", t)
    t = _tensors()
    t["exp_avg_sq"] = torch.zeros(3, 11)
    _refused(ValueError, r"exp_avg_sq has shape \(3, 11\)", t)
    t = _tensors()
    with pytest.raises(ValueError, match=r"out_lowp has shape \(34,\)"):
        _step(t, out_lowp=torch.empty(34, dtype=torch.bfloat16))


def test_non_contiguous_is_refused_not_copied():
    t = {k: torch.zeros(8, 6) for k in ("param", "grad", "exp_avg", "exp_avg_sq")}
    t["exp_avg"] = torch.zeros(6, 8).t()
    _refused(ValueError, r"exp_avg is not contiguous .*never through a temporary copy", t)
    t = _tensors(66)
    t["param"] = t["param"][::2]
    _refused(ValueError, "param is not contiguous", t)


def test_wrong_dtypes_name_the_tensor():
    t = _tensors()
    t["param"] = t["param"].double()
    _refused(TypeError, r"param has dtype torch.float64; expected torch.float32", t)
    t = _tensors()
    t["grad"] = t["grad"].to(torch.int32)
    _refused(TypeError, "grad has dtype torch.int32", t)
    t = _tensors()
    t["exp_avg"] = t["exp_avg"].bfloat16()
    _refused(TypeError, "exp_avg has dtype torch.bfloat16", t)
    with pytest.raises(TypeError, match="out_lowp has dtype torch.float32"):
        _step(_tensors(), out_lowp=torch.empty(33))
    with pytest.raises(TypeError, match="grad must be a torch.Tensor, got list"):
        adam_step(torch.zeros(2), [0.0, 0.0], torch.zeros(2), torch.zeros(2), **HYPER)


def test_meta_tensor_is_refused_by_device():
    t = _tensors()
    t["exp_avg"] = torch.empty(33, device="meta")
    _refused(ValueError, "exp_avg is on device meta", t)


@pytest.mark.requires_cuda
def test_cuda_tensor_is_refused_by_device():
    t = _tensors()
    t["grad"] = t["grad"].cuda()
    _refused(ValueError, "grad is on device cuda", t)


def test_sparse_grad_is_refused():
    t = _tensors()
    t["grad"] = t["grad"].to_sparse()
    _refused(ValueError, "grad has layout torch.sparse_coo", t)


def test_misaligned_pointer_is_refused():
    raw = bytearray(4 * 33 + 1)
    t = _tensors()
    t["exp_avg_sq"] = torch.frombuffer(raw, dtype=torch.float32, offset=1, count=33)
    _refused(ValueError, "exp_avg_sq data pointer .* not aligned to its 4-byte elements", t)


def test_aliased_buffers_are_refused():
    t = _tensors()
    t["exp_avg"] = t["param"]
    _refused(ValueError, "exp_avg and param share memory", t)
    buf = torch.zeros(50)
    t = _tensors()
    t["exp_avg"], t["exp_avg_sq"] = buf[:33], buf[17:]
    _refused(ValueError, "exp_avg_sq and exp_avg share memory", t)


@pytest.mark.parametrize(("kw", "match"), [
    ({"step": 0}, "step must be an int >= 1"),
    ({"step": 2.0}, "step must be an int >= 1"),
    ({"lr": -1e-3}, "Invalid learning rate"),
    ({"beta1": 1.0}, "Invalid beta parameter at index 0"),
    ({"beta2": -0.1}, "Invalid beta parameter at index 1"),
    ({"eps": float("nan")}, "Invalid epsilon value"),
    ({"weight_decay": -0.1}, "Invalid weight_decay value"),
    ({"grad_scale": float("inf")}, "grad_scale must be finite"),
    ({"threads": 0}, "threads must be an int >= 1"),
    ({"isa": "sse2"}, "isa='sse2' is not one of"),
])
def test_bad_hyperparameters_are_named(kw, match):
    _refused(ValueError, match, _tensors(), **kw)


@pytest.mark.parametrize("name", ["scalar", "avx2", "avx512"])
def test_isa_names_resolve(name):
    """Each ISA resolves to itself where the CPU runs it, else is refused by name."""
    assert resolve_isa("auto") == available_isas()[-1]
    if name in available_isas():
        assert resolve_isa(name) == name
    else:
        with pytest.raises(ValueError, match=f"isa='{name}' is not supported by this CPU"):
            resolve_isa(name)


def _c_params(**kw: object) -> object:
    base = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0,
            "grad_scale": 1.0, "step": 1, "adamw": 1, "isa": 0, "threads": 1}
    return ffi.new("struct inf_adam_params *", {**base, **kw})


def test_c_api_returns_einval_for_bad_arguments():
    """The C contract on its own: -EINVAL, never a crash, for what Python would have caught."""
    einval = -22
    buf = ffi.new("float[64]")
    p, g, m, v = buf, ffi.cast("void *", buf + 16), buf + 32, buf + 48
    F32, BF16, NONE = lib.INF_ADAM_DTYPE_F32, lib.INF_ADAM_DTYPE_BF16, lib.INF_ADAM_DTYPE_NONE
    assert lib.inf_adam_step(_c_params(), p, g, F32, m, v, ffi.NULL, NONE, 16) == 0
    assert lib.inf_adam_step(ffi.NULL, p, g, F32, m, v, ffi.NULL, NONE, 16) == einval
    assert lib.inf_adam_step(_c_params(step=0), p, g, F32, m, v, ffi.NULL, NONE, 16) == einval
    assert lib.inf_adam_step(_c_params(threads=0), p, g, F32, m, v, ffi.NULL, NONE, 16) == einval
    assert lib.inf_adam_step(_c_params(isa=9), p, g, F32, m, v, ffi.NULL, NONE, 16) == einval
    assert lib.inf_adam_step(_c_params(), p, g, 7, m, v, ffi.NULL, NONE, 16) == einval
    assert lib.inf_adam_step(_c_params(), p, g, F32, m, v, ffi.NULL, BF16, 16) == einval
    assert lib.inf_adam_step(_c_params(), ffi.NULL, g, F32, m, v, ffi.NULL, NONE, 16) == einval
    assert lib.inf_adam_step(_c_params(), p, g, F32, m, v, ffi.NULL, NONE, 17) == einval  # overlap
    odd = ffi.cast("float *", ffi.cast("char *", p) + 2)
    assert lib.inf_adam_step(_c_params(), odd, g, F32, m, v, ffi.NULL, NONE, 8) == einval
    assert lib.inf_adam_step(_c_params(), ffi.NULL, ffi.NULL, F32, ffi.NULL, ffi.NULL, ffi.NULL,
                             NONE, 0) == 0
    assert lib.inf_adam_isa_resolve(99) == einval


def test_a_graph_that_saved_a_stepped_tensor_fails_loudly():
    """The kernel writes behind autograd's back; versions are bumped as an in-place op would,
    so backward through a graph that saved the old param refuses instead of using new values."""
    w = torch.randn(33, requires_grad=True)
    loss = (w * w).sum()  # saves w
    t = _tensors()
    t["param"] = w.detach()  # shares w's memory and version counter
    _step(t)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_prepared_kernel_refuses_bad_values_when_made_not_at_each_call():
    from infinity.optim._native import AdamKernel
    with pytest.raises(ValueError, match="step must be an int >= 1"):
        AdamKernel(**{**HYPER, "step": 0})
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        AdamKernel(**{**HYPER, "beta2": 1.0})
    with pytest.raises(ValueError, match="grad_scale must be finite"):
        AdamKernel(**HYPER, grad_scale=float("inf"))
