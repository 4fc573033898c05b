"""CPUAdam as a drop-in for torch.optim.AdamW / Adam: same trajectory, interchangeable state."""

import copy

import pytest
import torch

from infinity.optim import CPUAdam

SHAPES = ((33, 7), (1000,), (17,), (4, 4, 4))
HYPER = {"lr": 3e-3, "betas": (0.85, 0.995), "eps": 1e-7, "weight_decay": 0.1}


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _torch_cls(adamw: bool) -> type[torch.optim.Optimizer]:
    return torch.optim.AdamW if adamw else torch.optim.Adam


def _feed(params: list[torch.nn.Parameter], step: int) -> None:
    """Deterministic gradients for step `step`, the same for every optimizer under test."""
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        _feed(params, step)
        opt.step()


def _assert_close(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    """Within 1e-6 relative (torch's vectorized sqrt can be an ulp off; see inf_adam.h)."""
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-6)
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_hundred_steps_match_torch(adamw):
    ours, ref = _params(0), _params(0)
    _train(CPUAdam(ours, adamw_mode=adamw, threads=2, **HYPER), ours, range(100))
    _train(_torch_cls(adamw)(ref, **HYPER), ref, range(100))
    _assert_close(ours, ref)


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_state_dict_loads_into_torch(adamw):
    ours, ref, resumed = _params(1), _params(1), _params(1)
    ours_opt = CPUAdam(ours, adamw_mode=adamw, **HYPER)
    ref_opt = _torch_cls(adamw)(ref, **HYPER)
    _train(ours_opt, ours, range(5))
    _train(ref_opt, ref, range(10))

    with torch.no_grad():
        for r, o in zip(resumed, ours, strict=True):
            r.copy_(o)
    torch_opt = _torch_cls(adamw)(resumed, lr=1.0)
    torch_opt.load_state_dict(copy.deepcopy(ours_opt.state_dict()))  # as if saved
    assert torch_opt.param_groups[0]["decoupled_weight_decay"] is adamw
    assert torch_opt.state[resumed[0]]["step"].item() == 5.0
    _train(torch_opt, resumed, range(5, 10))
    _assert_close(resumed, ref)


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_torch_state_dict_loads_into_cpu_adam(adamw):
    ref, resumed = _params(2), _params(2)
    torch_opt = _torch_cls(adamw)(ref, **HYPER)
    _train(torch_opt, ref, range(5))
    with torch.no_grad():
        for r, o in zip(resumed, ref, strict=True):
            r.copy_(o)
    ours_opt = CPUAdam(resumed, lr=1.0, adamw_mode=not adamw)
    ours_opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))  # as if saved
    assert ours_opt.param_groups[0]["lr"] == HYPER["lr"]
    _train(torch_opt, ref, range(5, 10))
    _train(ours_opt, resumed, range(5, 10))
    _assert_close(resumed, ref)
    assert ours_opt.state[resumed[0]]["step"].item() == 10.0


def test_state_keys_and_types_match_torch():
    ours, ref = _params(3), _params(3)
    ours_opt, ref_opt = CPUAdam(ours, **HYPER), torch.optim.AdamW(ref, **HYPER)
    _train(ours_opt, ours, range(1))
    _train(ref_opt, ref, range(1))
    ours_sd, ref_sd = ours_opt.state_dict(), ref_opt.state_dict()
    assert ours_sd["param_groups"] == ref_sd["param_groups"]
    for i in ref_sd["state"]:
        assert ours_sd["state"][i].keys() == ref_sd["state"][i].keys()
        for key, value in ref_sd["state"][i].items():
            assert ours_sd["state"][i][key].dtype == value.dtype, key
            assert ours_sd["state"][i][key].shape == value.shape, key


def test_closure_is_called_with_grad_enabled_and_its_loss_returned():
    model = torch.nn.Linear(5, 3)
    ref = torch.nn.Linear(5, 3)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(4))

    def closure_for(m: torch.nn.Module, opt: torch.optim.Optimizer):
        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = m(x).square().mean()
            loss.backward()
            return loss
        return closure

    ours_opt = CPUAdam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(3):
        loss = ours_opt.step(closure_for(model, ours_opt))
        ref_loss = ref_opt.step(closure_for(ref, ref_opt))
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    _assert_close(list(model.parameters()), list(ref.parameters()))


def test_params_without_grad_are_skipped():
    params = _params(5)
    opt = CPUAdam(params, **HYPER)
    before = params[1].detach().clone()
    _feed(params, 0)
    params[1].grad = None
    opt.step()
    assert torch.equal(params[1].detach(), before)
    assert params[1] not in opt.state


def test_bad_param_is_named_and_step_not_counted():
    good = torch.nn.Parameter(torch.randn(4))
    bad = torch.nn.Parameter(torch.randn(6, 4).t())  # non-contiguous
    opt = CPUAdam([{"params": [good]}, {"params": [bad]}])
    good.grad, bad.grad = torch.randn(4), torch.randn(4, 6)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] \(shape \(4, 6\)\)"
                                         r": param is not contiguous"):
        opt.step()
    assert opt.state[bad]["step"].item() == 0.0


def test_unsupported_torch_options_are_refused():
    params = _params(6)
    opt = CPUAdam(params)
    opt.param_groups[0]["amsgrad"] = True
    _feed(params, 0)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['amsgrad'\] is True"):
        opt.step()


@pytest.mark.parametrize(("kw", "match"), [
    ({"lr": -1.0}, "Invalid learning rate"),
    ({"betas": (1.0, 0.9)}, "Invalid beta parameter at index 0"),
    ({"weight_decay": -1.0}, "Invalid weight_decay value"),
    ({"threads": 0}, "threads must be an int >= 1"),
])
def test_bad_constructor_arguments_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        CPUAdam(_params(7), **kw)
