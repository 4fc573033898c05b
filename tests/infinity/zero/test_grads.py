"""Gradient buffers in RAM and in the store behave alike; HeldGrad keeps autograd's own tensors."""

import math

import pytest
import torch

from infinity.store import TensorStore, Tier
from infinity.zero import HeldGrad, RamGrad, Ranks, StoredGrad, grads, plan_units


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
        return StoredGrad("grad/u", numel, torch.float32, store, Tier.NVME, scatter=scatter,
                          name="param/u")

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


def _held(layer):
    (unit,), _ = plan_units(layer, persistence_numel=0)
    return unit, HeldGrad([s.shape.numel() for s in unit.slots], torch.float32, name="param/u")


def test_held_gradients_are_autograds_tensors_summed_in_place():
    """No copy: the pieces are the tensors `.grad` held (same memory), later micro-batches are
    added into them, a parameter without a gradient reads as zeros, zero() lets them go."""
    layer = torch.nn.Linear(3, 2)
    unit, buffer = _held(layer)
    with buffer.read_pieces() as pieces:
        assert not buffer.has_grad and [p.tolist() for p in pieces] == [[0.0] * 6, [0.0] * 2]
    weight_grad = torch.full((2, 3), 1.0)
    layer.weight.grad = weight_grad
    buffer.accumulate(unit.slots)
    assert layer.weight.grad is None and buffer.finite
    layer.weight.grad, layer.bias.grad = torch.full((2, 3), 2.0), torch.full((2,), -2.0)
    buffer.accumulate(unit.slots)
    with buffer.read_pieces() as (weight, bias):
        assert weight.data_ptr() == weight_grad.data_ptr() and weight.tolist() == [3.0] * 6
        assert bias.tolist() == [-2.0] * 2
    with buffer.read() as flat:
        assert flat.tolist() == [3.0] * 6 + [-2.0] * 2
    buffer.zero()
    assert not buffer.has_grad and buffer.finite is None
    layer.bias.grad = torch.full((2,), 5.0)  # the weight got none this step: zeros, not last step's
    buffer.accumulate(unit.slots)
    with buffer.read_pieces() as (weight, bias):
        assert weight.tolist() == [0.0] * 6 and bias.tolist() == [5.0] * 2


def test_a_held_gradient_not_contiguous_is_copied():
    layer = torch.nn.Linear(3, 2)
    unit, buffer = _held(layer)
    layer.weight.grad = torch.arange(6.0).view(3, 2).t()
    buffer.accumulate(unit.slots)
    with buffer.read_pieces() as (weight, bias):
        assert weight.is_contiguous() and weight.tolist() == [0.0, 2.0, 4.0, 1.0, 3.0, 5.0]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_held_gradients_know_whether_they_are_finite(value):
    """Checked where accumulated (autograd's output is still in cache), so the optimizer step
    needs no pass of its own; an overflow in a sum over micro-batches counts too."""
    layer = torch.nn.Linear(3, 2)
    unit, buffer = _held(layer)
    layer.weight.grad = torch.ones(2, 3)
    buffer.accumulate(unit.slots)
    assert buffer.finite is True
    bad = torch.ones(2)
    bad[1] = value
    layer.bias.grad = bad
    buffer.accumulate(unit.slots)
    assert buffer.finite is False
    layer.weight.grad = torch.ones(2, 3)
    buffer.accumulate(unit.slots)
    assert buffer.finite is False  # stays so until the next step
    buffer.zero()
    layer.weight.grad = torch.full((2, 3), 3e38)
    buffer.accumulate(unit.slots)
    layer.weight.grad = torch.full((2, 3), 3e38)
    buffer.accumulate(unit.slots)  # 6e38 overflows float32
    assert buffer.finite is False
    assert not hasattr(buffer, "average_over")  # one process: no flat buffer to average over ranks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_pieces_check_and_norm_term_is_its_sum_of_squares_in_double(dtype):
    """The global norm's terms: within a double's rounding of the exact sum (torch's float32
    norm of a large bf16 gradient is off by ~1e-5), non-finite exactly when the piece is."""
    torch.manual_seed(0)
    for numel in (4099, 1, 33, 1 << 16, 7):
        piece = (torch.randn(numel) * 3).to(dtype)
        exact = math.fsum(x * x for x in piece.double().tolist())
        assert grads.sum_squares(piece) == pytest.approx(exact, rel=1e-13, abs=0)
    bad = torch.ones(9, dtype=dtype)
    bad[4] = float("nan")
    assert math.isnan(grads.sum_squares(bad))
    assert not grads.pieces_are_finite([torch.ones(3, dtype=dtype), bad])
    assert grads.pieces_are_finite([torch.ones(3, dtype=dtype)])


def test_a_held_gradients_square_is_the_sums_its_check_took(monkeypatch):
    """At the boundary the finiteness check takes each piece's sum of squares, and the
    engine's norm term reuses it: one pass over the gradient, not two; the same value as a
    fresh pass."""
    layer = torch.nn.Linear(300, 20).to(torch.bfloat16)
    (unit,), _ = plan_units(layer, persistence_numel=0)
    buffer = HeldGrad([s.shape.numel() for s in unit.slots], torch.bfloat16, name="param/u")
    calls = []

    sum_squares = grads.sum_squares

    def counted(t):
        calls.append(t.numel())
        return sum_squares(t)

    monkeypatch.setattr(grads, "sum_squares", counted)
    torch.manual_seed(0)
    layer.weight.grad = torch.randn(20, 300).to(torch.bfloat16)
    layer.bias.grad = torch.randn(20).to(torch.bfloat16)
    buffer.accumulate(unit.slots)
    assert buffer.finite is True and calls == [6000, 20]
    with buffer.read_pieces() as pieces:
        fresh = sum(sum_squares(g) for g in pieces)
    assert buffer.square() == fresh and calls == [6000, 20]


def test_finite_values_whose_squares_overflow_float32_are_finite():
    """Squares past float32's range are summed in double: finite, and the norm they make."""
    layer = torch.nn.Linear(3, 2).to(torch.bfloat16)
    (unit,), _ = plan_units(layer, persistence_numel=0)
    buffer = HeldGrad([s.shape.numel() for s in unit.slots], torch.bfloat16, name="param/u")
    layer.weight.grad = torch.full((2, 3), 1e30, dtype=torch.bfloat16)
    buffer.accumulate(unit.slots)
    value = float(torch.tensor(1e30, dtype=torch.bfloat16))
    assert buffer.finite is True and buffer.square() == 6 * value * value


def test_a_held_gradient_off_the_boundary_is_not_checked_until_the_boundary(monkeypatch):
    """inf/nan survive the in-place sums: the micro-batches before the boundary take no pass;
    the boundary's check takes every piece added into since, and square() reuses it."""
    layer = torch.nn.Linear(30, 2).to(torch.bfloat16)
    (unit,), _ = plan_units(layer, persistence_numel=0)
    buffer = HeldGrad([s.shape.numel() for s in unit.slots], torch.bfloat16, name="param/u")
    calls = []
    sum_squares = grads.sum_squares
    monkeypatch.setattr(grads, "sum_squares", lambda t: calls.append(t.numel()) or
                        sum_squares(t))
    buffer.check_now = False
    layer.weight.grad = torch.ones(2, 30, dtype=torch.bfloat16)
    buffer.accumulate(unit.slots)
    assert buffer.finite is None and calls == []
    buffer.check_now = True
    layer.bias.grad = torch.ones(2, dtype=torch.bfloat16)
    buffer.accumulate(unit.slots)
    assert buffer.finite is True and sorted(calls) == [2, 60]
    assert buffer.square() == 62.0 and sorted(calls) == [2, 60]


def test_a_flat_gradients_square_is_taken_at_the_boundary_without_reading_it_back(make_buffer,
                                                                                 monkeypatch):
    """At the boundary accumulate takes the sum's square and finiteness while the buffer is in
    hand, and square() returns it without reading the buffer back (from the store, a wait on
    the training thread); a change after it (a micro-batch off the boundary, averaging, a new
    step) makes square() read again."""
    layer = torch.nn.Linear(3, 2)
    (unit,), _ = plan_units(layer, persistence_numel=0)
    buffer = make_buffer(unit.numel)
    reads = []
    read_pieces = type(buffer).read_pieces
    monkeypatch.setattr(type(buffer), "read_pieces",
                        lambda self: reads.append(1) or read_pieces(self))

    def add(weight, bias, *, check):
        buffer.check_now = check
        layer.weight.grad = torch.full((2, 3), weight)
        layer.bias.grad = torch.full((2,), bias)
        buffer.accumulate(unit.slots)

    add(1.0, 2.0, check=False)
    assert buffer.finite is None
    add(1.0, 2.0, check=True)  # the boundary: weight 2, bias 4
    assert buffer.finite is True
    assert buffer.square() == 6 * 4.0 + 2 * 16.0 and reads == []
    add(1.0, 0.0, check=False)  # changed after the check: read again
    assert buffer.finite is None
    assert buffer.square() == 6 * 9.0 + 2 * 16.0 and reads == [1]
    add(0.0, 0.0, check=True)
    buffer.average_over(LoneRank())  # the peer sends the same values: the average is unchanged
    assert buffer.square() == 6 * 9.0 + 2 * 16.0 and reads == [1, 1]
    buffer.zero()
    assert buffer.square() == 0.0
    add(math.inf, 0.0, check=True)
    assert buffer.finite is False and math.isinf(buffer.square()) and reads == [1, 1]


def test_a_scattered_buffer_takes_its_shards_square_at_the_boundary_without_reading_it_back(
        make_buffer, monkeypatch):
    """Stages 2-3 take the square of the shard they keep as the unscattered buffers do: in
    hand at the boundary, not read back (from the store) for square()."""
    layer = torch.nn.Linear(3, 2)
    (unit,), _ = plan_units(layer, persistence_numel=0)
    buffer = make_buffer(Ranks(1, 2).shard(unit.numel).numel, scatter=LoneRank())
    reads = []
    read_pieces = type(buffer).read_pieces
    monkeypatch.setattr(type(buffer), "read_pieces",
                        lambda self: reads.append(1) or read_pieces(self))
    for check in (False, True):
        buffer.check_now = check
        layer.weight.grad = torch.arange(6.0).view(2, 3)
        layer.bias.grad = torch.full((2,), -1.0)
        buffer.accumulate(unit.slots)
    # rank 1 keeps elements [4, 8): weight 4, 5 and bias -1, -1, each summed twice
    assert buffer.finite is True
    assert buffer.square() == 8.0 ** 2 + 10.0 ** 2 + 2 * 2.0 ** 2 and reads == []


class InfRank(LoneRank):
    """A peer whose gradient holds an inf: the average does too."""

    def all_reduce_mean_(self, t, what):
        super().all_reduce_mean_(t, what)
        t[0] = math.inf


def test_a_flat_gradient_checked_finite_is_unknown_again_after_averaging(make_buffer):
    """The boundary's check saw this rank's sum; the average over the ranks may bring another
    rank's inf/nan, so neither the finding nor the square may outlive it."""
    layer = torch.nn.Linear(3, 2)
    (unit,), _ = plan_units(layer, persistence_numel=0)
    buffer = make_buffer(unit.numel)
    layer.weight.grad = torch.ones(2, 3)
    buffer.accumulate(unit.slots)
    assert buffer.finite is True and buffer.square() == 6.0
    buffer.average_over(InfRank())
    assert buffer.finite is None
    assert not buffer.is_finite() and math.isinf(buffer.square())


def test_a_stored_gradient_overwrites_its_entry_without_reading_the_last_steps(tmp_path):
    layer = torch.nn.Linear(3, 2)
    (unit,), _ = plan_units(layer, persistence_numel=0)
    with TensorStore({"host": 1 << 16, "nvme": 1 << 20}, nvme_path=tmp_path) as store:
        buffer = StoredGrad("grad/u", unit.numel, torch.float32, store, Tier.NVME)

        def step(weight, bias):
            buffer.zero()
            store.flush()
            store.evict("grad/u", "host")  # only the NVMe copy holds the last step's
            reads = store.stats()["moves"].get("nvme->host", {}).get("moves", 0)
            layer.weight.grad = torch.full((2, 3), weight)
            layer.bias.grad = None if bias is None else torch.full((2,), bias)
            buffer.accumulate(unit.slots)
            store.flush()
            assert store.stats()["moves"].get("nvme->host", {}).get("moves", 0) == reads
            store.evict("grad/u", "host")
            with buffer.read() as flat:
                return flat.tolist()

        assert step(2.0, -2.0) == [2.0] * 6 + [-2.0] * 2
        assert step(4.0, -4.0) == [4.0] * 6 + [-4.0] * 2
        assert step(1.0, None) == [1.0] * 6 + [0.0] * 2  # not the last step's -4


def test_a_stored_gradient_is_read_ahead_only_when_it_holds_one(tmp_path):
    """read_ahead starts the read of a stored gradient the host tier lost, so the optimizer's
    read_pieces finds it there; a buffer with nothing this step reads nothing."""
    layer = torch.nn.Linear(3, 2)
    (unit,), _ = plan_units(layer, persistence_numel=0)
    with TensorStore({"host": 1 << 16, "nvme": 1 << 20}, nvme_path=tmp_path) as store:
        buffer = StoredGrad("grad/u", unit.numel, torch.float32, store, Tier.NVME)

        def reads():
            return store.stats()["moves"].get("nvme->host", {}).get("moves", 0)

        store.evict("grad/u", "host")
        buffer.read_ahead()  # no gradient yet this step
        assert reads() == 0 and store.tiers_of("grad/u") == ["nvme"]
        layer.weight.grad, layer.bias.grad = torch.full((2, 3), 3.0), torch.full((2,), 5.0)
        buffer.accumulate(unit.slots)
        store.flush()
        store.evict("grad/u", "host")
        buffer.read_ahead()
        assert "host" in store.tiers_of("grad/u")  # read (or being read) into RAM
        with buffer.read() as flat:
            assert flat.tolist() == [3.0] * 6 + [5.0] * 2
        assert reads() == 1  # read_pieces found it there: one read in all
        RamGrad(8, torch.float32).read_ahead()  # in RAM: nothing to do
