"""The smallest host budgets the memory plan accepts train, with the optimizer overlapped with
backward (issue 7: the host tier fragmented under copies in use and a gradient found no hole,
although the plan had accepted the budget)."""

import json

import pytest
import torch

import infinity
from infinity.errors import BudgetError
from infinity.train.models import DEFAULTS, default_model

# One worker runs this module: its fixture runs once (--dist=loadgroup in pyproject.toml).
pytestmark = pytest.mark.xdist_group("engine_tight_budget")


def _config(tmp_path, budget=None):
    config = json.loads((DEFAULTS / "ds_config.json").read_text())  # the shipped one: all on NVMe
    for key in ("offload_param", "offload_optimizer"):
        config["zero_optimization"][key]["nvme_path"] = str(tmp_path)
    if budget is not None:
        config["infinity"]["host_memory_budget"] = budget
    return config


@pytest.fixture(scope="module")
def min_budget(tmp_path_factory):
    model, _ = default_model()
    with infinity.initialize(model, _config(tmp_path_factory.mktemp("nvme"))) as engine:
        return engine.plan.min_host_budget


def _train(train_lm, tmp_path, budget, *, overlap, steps=3):
    model, _ = default_model()
    # the CLI's shape
    ids = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(0))
    config = _config(tmp_path, budget)
    config["infinity"]["overlap_optimizer"] = overlap
    with infinity.initialize(model, config) as engine:
        assert engine.overlap is overlap
        losses = train_lm(engine, [ids] * steps)
        return losses, engine.units_stepped_in_backward, dict(engine.named_parameters())


@pytest.mark.parametrize("above", [0, 572_064, 1_272_064])  # 2.73 MB (the minimum), 3.3 MB, 4.0 MB
def test_the_plans_smallest_budgets_train_with_the_optimizer_overlapped(tmp_path, min_budget,
                                                                        above, train_lm):
    """3.3 MB failed before issue 7's fix: BudgetError for 'grad/param/lm_head' at step 1."""
    losses, stepped, _ = _train(train_lm, tmp_path, min_budget + above, overlap=True)
    assert stepped > 0  # units were stepped on the worker during backward
    assert all(map(lambda x: x == x, losses)) and losses[-1] < losses[0]


def test_at_the_minimum_budget_the_overlapped_step_equals_the_step_after_backward(
        tmp_path, min_budget, train_lm):
    overlapped = _train(train_lm, tmp_path, min_budget, overlap=True, steps=2)
    after = _train(train_lm, tmp_path, min_budget, overlap=False, steps=2)
    assert overlapped[0] == after[0]
    for name, value in after[2].items():
        assert torch.equal(overlapped[2][name], value), name


def test_a_budget_below_the_minimum_fails_at_initialize_naming_both(tmp_path, min_budget):
    """Refused by the plan, before anything is moved or written."""
    model, _ = default_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(BudgetError, match=f"host_memory_budget {min_budget - 1} bytes "
                                          f".* at least {min_budget} bytes"):
        infinity.initialize(model, _config(tmp_path, min_budget - 1))
    assert list(tmp_path.iterdir()) == []  # no swap file was ever made there
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name


def test_infinity_train_runs_at_the_plans_minimum_budget(tmp_path, min_budget, capsys):
    from infinity.cli import train  # the CLI over the same engine

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_config(tmp_path, min_budget)))
    assert train.main(["--config", str(path), "--steps", "3", "--nvme-path", str(tmp_path)]) == 0
    assert "steps         3 of 3" in capsys.readouterr().out
