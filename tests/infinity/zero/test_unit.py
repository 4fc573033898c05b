"""Cutting a model into fetch units, and placing them in the store."""

import pytest
import torch

from infinity.store import TensorStore, Tier
from infinity.zero import UnitState, place_units, plan_units


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_a_tied_parameter_is_one_unit_used_by_every_module_holding_it():
    model = Tied()
    units, uses = plan_units(model, persistence_numel=4)
    embed_unit = next(u for u in units if u.name == "embed")
    assert [s.name for s in embed_unit.slots] == ["embed.weight"]
    assert uses[model.embed] == [embed_unit] and uses[model.head] == [embed_unit]
    resident = [u for u in units if u.persistent]
    assert len(resident) == 1 and {s.name for s in resident[0].slots} == {"norm.weight",
                                                                          "norm.bias"}
    assert model.norm not in uses  # resident units are not fetched per module
    assert sum(u.numel for u in units) == sum(p.numel() for p in model.parameters())


def test_units_split_by_dtype_and_requires_grad():
    layer = torch.nn.Linear(6, 6)
    layer.bias.requires_grad_(False)
    units, _ = plan_units(layer, persistence_numel=0)
    assert sorted((u.requires_grad, u.numel) for u in units) == [(False, 6), (True, 36)]
    assert len({u.key for u in units}) == 2
    layer.bias.data = layer.bias.data.half()
    units, _ = plan_units(torch.nn.Sequential(layer), persistence_numel=0)
    assert {u.dtype for u in units} == {torch.float32, torch.float16}


def test_meta_parameters_are_refused_by_name():
    with torch.device("meta"):
        layer = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="'weight' is on the meta device"):
        plan_units(layer, persistence_numel=0)


def test_placed_units_leave_placeholders_and_keep_the_values(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    units, _ = plan_units(model, persistence_numel=0)
    with TensorStore({"host": 1 << 20, "nvme": 1 << 20}, nvme_path=tmp_path) as store:
        place_units(units, store, home=Tier.NVME, device=torch.device("cpu"))
        for u in units:
            assert u.state is UnitState.RELEASED and store.tiers_of(u.key) == ["nvme"]
            flat = store.fetch(u.key, Tier.HOST).result()
            for s in u.slots:
                assert s.param.numel() == 0 and s.param.dtype == u.dtype
                assert torch.equal(flat[s.offset:s.offset + s.shape.numel()].view(s.shape),
                                   expected[s.name])
            store.release(u.key, Tier.HOST)
