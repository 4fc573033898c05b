"""Gradient buffers in RAM and in the store behave alike."""

import pytest
import torch

from infinity.store import TensorStore, Tier
from infinity.zero import RamGrad, StoredGrad, plan_units


@pytest.fixture(params=["ram", "store"])
def make_buffer(request, tmp_path):
    store = TensorStore({"host": 1 << 16, "nvme": 1 << 20}, nvme_path=tmp_path)

    def make(numel):
        if request.param == "ram":
            return RamGrad(numel, torch.float32)
        return StoredGrad("grad/u", numel, torch.float32, store, Tier.NVME)

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
