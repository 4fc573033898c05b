"""The coordinator driven by its hooks: values arrive before a module runs and leave after,
gradients land in the units' buffers, traces drive prefetch."""

import contextlib
import copy
import threading

import pytest
import torch

from infinity.errors import WouldWait
from infinity.store import TensorStore, Tier
from infinity.zero import ModelHooks, ParamCoordinator, UnitState, place_units, plan_units
from infinity.zero.saved_views import SavedView


@contextlib.contextmanager
def managed(model, tmp_path, *, host_nbytes=1 << 20, prefetch_numel=10**9, reuse_numel=0,
            persistence=0, storage_dtype=None, **callbacks):
    units, uses = plan_units(model, persistence_numel=persistence, storage_dtype=storage_dtype)
    store = TensorStore({"host": host_nbytes, "nvme": 1 << 22}, nvme_path=tmp_path)
    place_units(units, store, home=Tier.NVME, device=torch.device("cpu"))
    coordinator = ParamCoordinator(units, store, fetch_tier=Tier.HOST, device=torch.device("cpu"),
                                   prefetch_numel=prefetch_numel, max_live_numel=10**9,
                                   max_reuse_numel=reuse_numel, **callbacks)
    hooks = ModelHooks(model, units, uses, coordinator)
    try:
        yield units, coordinator
    finally:
        coordinator.release_all()
        hooks.remove()
        store.close()


def unit_grads(units):
    grads = {}
    for u in units:
        if u.grad is not None:
            with u.grad.read() as flat:
                grads.update({
                    s.name: flat[s.offset:s.offset + s.shape.numel()].view(s.shape).clone()
                    for s in u.slots})
    return grads


def assert_grads_match(units, reference, scale=1.0):
    grads = unit_grads(units)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name] / scale, p.grad, rtol=1e-6, atol=1e-7, msg=name)


class Shared(torch.nn.Module):
    """An embedding tied to the output layer, and one block called twice."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(11, 8)
        self.block = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 11, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)  # (B, T, 8)
        h = torch.tanh(self.block(h))
        h = torch.tanh(self.block(h))
        return self.out(h)


def loss(model, ids):
    return model(ids).logsumexp(-1).mean()


def test_tied_and_twice_used_parameters_get_the_reference_gradients(tmp_path):
    model = Shared()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 11, (2, 5))
    with managed(model, tmp_path) as (units, coordinator):
        for _ in range(2):  # accumulates over two micro-batches
            loss(model, ids).backward()
            coordinator.end_backward()
            assert all(p.grad is None for p in model.parameters())
            assert all(u.state is UnitState.RELEASED for u in units)
            assert all(p.numel() == 0 for p in model.parameters())
        loss(reference, ids).backward()
        assert_grads_match(units, reference, scale=2.0)


def test_backward_is_right_when_released_blocks_hold_other_units(tmp_path):
    """A host tier with room for about two units: every block is reused between forward and
    backward, so saved views of weights must be rebuilt from the unit (not the old block)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32, bias=False) for _ in range(6)])
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4, 32)  # 3-D input: linear saves a view (weight.t()) for backward
    with managed(model, tmp_path, host_nbytes=3 * 4096 + 8192,
                 prefetch_numel=0) as (units, coordinator):
        model(x).square().sum().backward()
        coordinator.end_backward()
        reference(x).square().sum().backward()
        assert_grads_match(units, reference)


class Peeking(torch.nn.Linear):
    """Keeps a view of its weight past its forward, as a careless user module may."""

    def forward(self, x):
        self.peek = self.weight[0]
        return super().forward(x)


def test_upcast_copies_reuse_buffers_and_keep_none_that_a_view_outlived(tmp_path):
    """bf16 values computed in fp32: each use's copy goes into a buffer kept from an earlier
    use ([Note: reused upcast buffers]) and backward is exactly that of the bf16-rounded
    model in fp32; a buffer whose view outlived its unit's release is never written again."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32, bias=False) for _ in range(5)],
                                Peeking(32, 32, bias=False))
    reference = copy.deepcopy(model).bfloat16().float()
    x = torch.randn(3, 4, 32)
    with managed(model, tmp_path, prefetch_numel=0, storage_dtype=torch.bfloat16) as (
            units, coordinator):
        upcasts = coordinator.upcasts
        assert upcasts.capacity == 2 * 32 * 32 * 4
        for _ in range(2):
            model(x).square().sum().backward()
            coordinator.end_backward()
            reference(x).square().sum().backward()
            assert upcasts.lent_bytes == 0 and upcasts.kept_bytes <= upcasts.capacity
        assert upcasts.reused >= 20 and upcasts.fresh <= 4, (upcasts.reused, upcasts.fresh)
        peek = model[5].peek
        assert_grads_match(units, reference)
        model[:5](x)  # five more copies, none into the buffer `peek` views
        assert torch.equal(peek, reference[5].weight[0])


def test_saved_views_are_recorded_by_position(tmp_path):
    layer = torch.nn.Linear(4, 4, bias=False)
    expected = layer.weight.detach().t().clone()
    with managed(layer, tmp_path) as (units, coordinator):
        coordinator.acquire(units)
        saved = coordinator.pack(layer.weight.t())
        assert isinstance(saved, SavedView) and saved.unit is units[0] and saved.stride == (1, 4)
        other = torch.ones(3)
        assert coordinator.pack(other) is other
        coordinator.release(units)
        coordinator.release_all()
        assert layer.weight.numel() == 0
        # Unpacked after the unit left: fetched again, and held until backward ends.
        torch.testing.assert_close(coordinator.unpack(saved), expected)
        assert units[0].state is UnitState.READY and units[0].held_for_backward
        coordinator.end_backward()
        assert units[0].state is UnitState.RELEASED


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(6, 6) for _ in range(3))

    def forward(self, x, route):
        x = self.a(x)
        return self.c(self.b(x)) if route else self.c(x)


def test_routes_get_their_own_traces_and_prefetch_after_recording(tmp_path):
    model = Branchy()
    x = torch.randn(2, 6)
    with managed(model, tmp_path) as (units, coordinator), torch.no_grad():
        for route in (True, False):
            model(x, route)
        assert coordinator.stats.divergences == 1  # the second route left the first's trace
        assert coordinator.traces((True, False)) == 2
        before = coordinator.stats.on_demand
        for route in (True, False, False, True):
            model(x, route)
        assert coordinator.stats.on_demand == before
        assert all(u.state is UnitState.RELEASED for u in units)


def test_a_divergence_falls_back_to_on_demand_for_the_rest_of_the_pass(tmp_path):
    model = Branchy()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 6)
    with managed(model, tmp_path) as (units, coordinator), torch.no_grad():
        model(x, True)
        before = coordinator.stats.on_demand
        out = model(x, False)
        assert coordinator.stats.divergences == 1
        assert coordinator.stats.on_demand == before + 1  # c, fetched when needed
        torch.testing.assert_close(out, reference(x, False))


def test_reuse_distance_keeps_a_unit_between_its_uses(tmp_path):
    model = Shared()
    ids = torch.randint(0, 11, (2, 5))
    with managed(model, tmp_path, reuse_numel=10**6) as (units, coordinator), torch.no_grad():
        loss(model, ids)
        assert coordinator.stats.kept == 0  # the first pass records the trace
        loss(model, ids)
        assert coordinator.stats.kept == 2  # the block between its two calls, embed for out


def test_frozen_units_get_no_gradient_and_are_released(tmp_path):
    model = Shared()
    model.block.requires_grad_(False)
    with managed(model, tmp_path) as (units, coordinator):
        loss(model, torch.randint(0, 11, (2, 5))).backward()
        coordinator.end_backward()
        frozen = next(u for u in units if u.name == "block")
        assert not frozen.requires_grad and frozen.grad is None
        assert all(u.state is UnitState.RELEASED for u in units)


def test_wrong_use_is_refused(tmp_path):
    layer = torch.nn.Linear(3, 3)
    with managed(layer, tmp_path) as (units, coordinator):
        with pytest.raises(RuntimeError, match="released more often than acquired"):
            coordinator.release(units)
        coordinator.acquire(units)
        with pytest.raises(RuntimeError, match="still used"):
            coordinator.release_all()
        with pytest.raises(RuntimeError, match="is ready, expected released"):
            units[0].expect(UnitState.RELEASED)
        coordinator.release(units)


def test_remove_leaves_no_hook(tmp_path):
    model = Shared()
    with managed(model, tmp_path):
        assert model.embed._forward_pre_hooks and model.embed.weight._post_accumulate_grad_hooks
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


class Failing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x, fail):
        x = self.a(x)
        if fail:
            raise ValueError("bad batch")
        return self.b(x)


def test_a_failed_forward_releases_what_it_held(tmp_path):
    model = Failing()
    x = torch.randn(2, 4)
    with managed(model, tmp_path) as (units, coordinator):
        with pytest.raises(ValueError, match="bad batch"):
            model(x, True)
        assert all(u.state is UnitState.RELEASED and u.users == 0 for u in units)
        model(x, False).sum().backward()
        coordinator.end_backward()
        assert all(u.grad is not None for u in units)


def test_units_kept_for_reuse_give_way_to_read_ahead_of_sooner_ones(tmp_path):
    # DeepSpeed's default reuse distance keeps every forward unit for its backward; a host tier of
    # five units fills with them mid-forward, and read-ahead must still find room, so the second
    # pass fetches nothing on demand.
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(8)])
    reference = copy.deepcopy(model)
    x = torch.randn(3, 64)
    with managed(model, tmp_path, host_nbytes=5 * 64 * 64 * 4, prefetch_numel=2 * 64 * 64,
                  reuse_numel=10**9) as (units, coordinator):
        for _ in range(2):
            model(x).square().sum().backward()
            coordinator.end_backward()
            if coordinator.stats.trace_switches == 0:
                after_first = coordinator.stats.on_demand
        assert coordinator.stats.trace_switches == 1
        assert coordinator.stats.on_demand == after_first, coordinator.stats
        assert coordinator.stats.kept == 5  # reuse still happens where it fits: the host tier
        reference(x).square().sum().backward()
        assert_grads_match(units, reference, scale=2)  # summed over the two passes


def test_callbacks_run_outside_the_lock_so_other_threads_may_use_the_coordinator(tmp_path):
    """[Note: callbacks outside the lock]: the engine's `ready(unit, True)` waits for its
    optimizer worker, and `on_grads_final` may run a collective or wait for room on the worker,
    while another thread (the worker, autograd's device thread) calls into the coordinator.
    Called with the lock held, as before, each such wait was a deadlock: here the other
    thread's call must end while the callback waits for it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    updated = set()  # units whose (pretended) optimizer step has ended: ready from then on
    waits = []  # (callback, unit, whether the other thread's call ended while it waited)

    def another_thread_uses_the_coordinator(what, unit):
        other = threading.Thread(target=coordinator.pack, args=(torch.ones(1),))
        other.start()
        other.join(timeout=30)  # a deadlock guard, not a timing: the call takes microseconds
        waits.append((what, unit.name, not other.is_alive()))

    def ready(unit, wait):
        if wait:
            another_thread_uses_the_coordinator("ready", unit)
            updated.add(unit)
        return unit in updated

    def grads_final(unit):
        another_thread_uses_the_coordinator("grads final", unit)

    x = torch.randn(3, 4)
    with managed(model, tmp_path, ready=ready, on_grads_final=grads_final) as (units, coordinator):
        model(x).square().sum().backward()
        coordinator.end_backward()
        assert coordinator.stats.after_optimizer == 2  # both waited for their "step"
    assert sorted(waits) == [("grads final", "0", True), ("grads final", "2", True),
                             ("ready", "0", True), ("ready", "2", True)]


class Revisit(torch.nn.Module):
    """Six layers in a row, the second called again after the fifth."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(6))

    def forward(self, h):
        for i in (0, 1, 2, 3, 4, 1, 5):
            h = torch.tanh(self.layers[i](h))
        return h


def test_read_ahead_past_the_next_unit_does_not_wait_for_room(tmp_path):
    """[Note: read ahead without waiting]: the next unit's read ahead may wait for room, those
    after it may not (`store.fetch(wait=False)`); refused (WouldWait), the read ahead stops and
    goes on after the next use, so each unit is still read one use ahead and nothing is fetched
    on demand; the unit kept for reuse is not let go for it. Every fetch only reads."""
    model = Revisit()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 16)
    with managed(model, tmp_path, reuse_numel=10**6) as (units, coordinator), torch.no_grad():
        model(x)  # records the trace
        kept = coordinator.stats.kept
        model(x)
        kept_a_pass = coordinator.stats.kept - kept
        assert kept_a_pass == 1  # the second layer, between its two calls
        store = coordinator.store
        calls = []
        fetch = store.fetch

        def refusing_fetch(key, tier=Tier.HOST, *, wait=True, **kwargs):
            calls.append((key, wait))
            assert kwargs.get("reads_only"), kwargs  # values are never written in a pass
            if not wait:
                raise WouldWait(f"{key!r}: room would wait (test)")
            return fetch(key, tier, wait=wait, **kwargs)

        store.fetch = refusing_fetch
        before, kept = coordinator.stats.on_demand, coordinator.stats.kept
        out = model(x)
        assert any(not wait for _, wait in calls), calls  # it reached past the next unit
        assert any(wait for _, wait in calls), calls  # and the next one was read ahead
        assert coordinator.stats.on_demand == before, coordinator.stats
        assert coordinator.stats.kept - kept == kept_a_pass, coordinator.stats
        torch.testing.assert_close(out, reference(x))
