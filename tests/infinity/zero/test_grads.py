"""Gradient buffers in RAM and in the store behave alike."""

import pytest
import torch

from infinity.store import TensorStore, Tier
from infinity.zero import RamGrad, Ranks, StoredGrad, plan_units


class LoneRank(Ranks):
    """Rank 1 of 2 whose peer always sends what it sends (so averages are its own values):
    the buffers' collective bookkeeping without a process group."""

    def __init__(self):
        super().__init__(1, 2)
        self.calls = []

    def reduce_scatter_mean(self, full, what):
        self.calls.append(what)
        n = full.numel() // self.world
        return full[self.rank * n:(self.rank + 1) * n].clone()

    def all_reduce_mean_(self, t, what):
        self.calls.append(what)


@pytest.fixture(params=["ram", "store"])
def make_buffer(request, tmp_path):
    store = TensorStore({"host": 1 << 16, "nvme": 1 << 20}, nvme_path=tmp_path)

    def make(numel, scatter=None):
        if request.param == "ram":
            return RamGrad(numel, torch.float32, scatter=scatter, name="param/u")
        return StoredGrad("grad/u", numel, torch.float32, store, Tier.NVME, scatter=scatter, name="param/u")

    yield make
    store.close()


def test_gradients_add_up_over_micro_batches_and_a_step_starts_clean(make_buffer):
    layer = torch.nn.Linear(3, 2)
    (unit,), _ = plan_units(layer, persistence_numel=0)
    buffer = make_buffer(unit.numel)
    with buffer.read() as flat:
        assert not buffer.has_grad and torch.equal(flat, torch.zeros(8))
    for scale in (1.0, 2.0):
        layer.weight.grad = torch.full((2, 3), scale)
        layer.bias.grad = torch.full((2,), -scale)
        buffer.accumulate(unit.slots)
        assert layer.weight.grad is None and layer.bias.grad is None
    with buffer.read() as flat:
        assert flat.tolist() == [3.0] * 6 + [-3.0] * 2
    buffer.zero()
    layer.weight.grad = torch.ones(2, 3)  # the bias got no gradient this step: its slice is zero
    buffer.accumulate(unit.slots)
    with buffer.read() as flat:
        assert flat.tolist() == [1.0] * 6 + [0.0] * 2


def test_a_scattered_buffer_keeps_this_ranks_shard_summed_over_micro_batches(make_buffer):
    """Stages 2-3: each accumulate reduce-scatters the whole (padded) gradient and adds the
    shard; rank 1 of 2 holds elements [4, 8) of the 8 (weight 6, bias 2)."""
    layer = torch.nn.Linear(3, 2)
    (unit,), _ = plan_units(layer, persistence_numel=0)
    ranks = LoneRank()
    buffer = make_buffer(Ranks(1, 2).shard(unit.numel).numel, scatter=ranks)
    for scale in (1.0, 2.0):
        layer.weight.grad = torch.arange(6.0).view(2, 3) * scale
        layer.bias.grad = torch.full((2,), -scale)
        buffer.accumulate(unit.slots)
        assert layer.weight.grad is None and layer.bias.grad is None
    with buffer.read() as flat:
        assert flat.tolist() == [12.0, 15.0, -3.0, -3.0]
    assert ranks.calls == ["gradient param/u"] * 2


def test_averaging_counts_zeros_where_no_gradient_arrived(make_buffer):
    """Stages 0-1: every rank takes part in the all-reduce, with zeros if it got nothing."""
    layer = torch.nn.Linear(3, 2)
    (unit,), _ = plan_units(layer, persistence_numel=0)
    ranks = LoneRank()
    buffer = make_buffer(8)
    layer.weight.grad = torch.ones(2, 3)
    buffer.accumulate(unit.slots)
    buffer.zero()  # a new step: the last step's values are stale
    buffer.average_over(ranks)
    assert buffer.has_grad and ranks.calls == ["gradient param/u"]
    with buffer.read() as flat:
        assert torch.equal(flat, torch.zeros(8))
