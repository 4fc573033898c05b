"""Engine.named_parameters(select) / parameter_specs: stream parameters out one unit at a time,
reading only the units that hold a selected name."""

import torch

from infinity.engine import initialize, parameter_specs


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def nvme_config(tmp_path) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_optimizer": {"device": "cpu"}}
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def test_specs_and_values_match_the_model(tmp_path):
    reference = model()
    want = {n: p.detach().clone() for n, p in reference.named_parameters()}
    engine = initialize(model(), nvme_config(tmp_path))
    specs = parameter_specs(engine)
    assert [s.name for s in specs] == list(want)
    assert all(s.shape == want[s.name].shape and s.dtype == torch.float32 and s.requires_grad
               for s in specs)
    assert sum(s.nbytes for s in specs) == sum(t.numel() * 4 for t in want.values())
    got = dict(engine.named_parameters())
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    engine.close()


def test_selection_reads_only_the_units_it_needs(tmp_path, monkeypatch):
    engine = initialize(model(), nvme_config(tmp_path))
    loss = engine(torch.ones(2, 8)).square().mean()
    engine.backward(loss)
    engine.step()
    engine.synchronize()  # the step's optimizer work is done: only the selection reads below
    fetched = []
    fetch = engine.store.fetch
    monkeypatch.setattr(engine.store, "fetch",
                        lambda key, *a, **k: fetched.append(key) or fetch(key, *a, **k))
    got = list(engine.named_parameters(lambda name: name.startswith("2.")))
    assert [n for n, _ in got] == ["2.weight", "2.bias"]
    assert fetched == ["param/2"]
    monkeypatch.undo()
    want = dict(engine.named_parameters())  # the trained values, not the model's start
    assert all(torch.equal(t, want[n]) for n, t in got)
    engine.close()
