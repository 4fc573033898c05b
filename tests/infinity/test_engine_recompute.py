"""infinity.recompute.run under the engine: the recompute fetches parameters again
along a trace that includes it (prefetched from step 2), training equals the same model trained
without recomputation, and the activation memory it saves is measured in child processes."""

import copy
import json
import logging
import os

import pytest
import torch
from children import python_child

import infinity
from infinity import recompute

LR = 1e-2


@pytest.fixture(autouse=True)
def _fresh_settings():
    recompute.reset()
    yield
    recompute.reset()


class Stack(torch.nn.Module):
    """Residual blocks (Linear, GELU, Dropout, Linear), each recomputed when asked."""

    def __init__(self, width: int = 12, hidden: int = 48, depth: int = 4, *,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.GELU(),
                                torch.nn.Dropout(dropout), torch.nn.Linear(hidden, width))
            for _ in range(depth))
        self.out = torch.nn.Linear(width, 4)
        self.recompute: dict | None = None  # recompute.run()'s keywords, or None: no recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = h + (b(h) if self.recompute is None else recompute.run(b, h, **self.recompute))
        return self.out(h)


def batches(n: int, rows: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(rows, 8, generator=g) for _ in range(n)]


def engine_config(tmp_path, device: str, **extra) -> dict:
    offload = {"device": device, **({"nvme_path": str(tmp_path)} if device == "nvme" else {})}
    return {"train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_prefetch_bucket_size": 2000,
                                  "stage3_max_reuse_distance": 0,
                                  "sub_group_size": 1 << 20, "offload_param": offload,
                                  "offload_optimizer": offload},
            "infinity": {"host_memory_budget": "256MB"}, **extra}


def train(model_or_engine, data, step) -> list[float]:
    losses = []
    torch.manual_seed(7)  # dropout draws the same masks in every run
    for x in data:
        loss = model_or_engine(x).square().mean()
        step(loss)
        losses.append(loss.item())
    return losses


def train_plain(model, data):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)

    def step(loss):
        loss.backward()
        opt.step()
        opt.zero_grad()
    return train(model, data, step)


def train_with(engine, data, per_step: list | None = None):
    def step(loss):
        engine.backward(loss)
        engine.step()
        if per_step is not None:
            per_step.append(dict(engine.stats()["prefetch"]))
    return train(engine, data, step)


def assert_parity(model, reference, losses, want_losses):
    for got, want in zip(losses, want_losses, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, want_losses)
    want = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert (p - want[name]).abs().max().item() <= 1e-5 * want[name].abs().max().item(), name


def step_deltas(per_step: list[dict], key: str) -> list[int]:
    values = [0] + [s[key] for s in per_step]
    return [b - a for a, b in zip(values, values[1:])]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_recompute_is_on_the_trace_prefetched_and_training_matches_no_recompute(tmp_path,
                                                                               reentrant):
    torch.manual_seed(0)
    model = Stack()
    reference = copy.deepcopy(model)
    data = batches(6)
    plain_stats: list[dict] = []
    (tmp_path / "plain").mkdir()
    (tmp_path / "recompute").mkdir()
    plain_model = copy.deepcopy(model)
    plain = infinity.initialize(plain_model, engine_config(tmp_path / "plain", "nvme"))
    plain_losses = train_with(plain, data, plain_stats)
    plain.close()

    model.recompute = {"use_reentrant": reentrant}
    engine = infinity.initialize(model, engine_config(tmp_path / "recompute", "nvme"))
    per_step: list[dict] = []
    losses = train_with(engine, data, per_step)
    engine.close()
    assert losses == plain_losses  # bit for bit what the same training without checkpointing gives
    checkpointed = dict(model.named_parameters())
    for name, p in plain_model.named_parameters():
        assert torch.equal(checkpointed[name], p), name
    assert_parity(model, reference, losses, train_plain(reference, data))

    recomputed = [a - b for a, b in zip(step_deltas(per_step, "acquires"),
                                        step_deltas(plain_stats, "acquires"))]
    assert recomputed == [len(model.blocks) * 2] * len(data), (
        "each block's two Linears fetched again")
    assert step_deltas(per_step, "on_demand_nvme")[1:] == [0] * (len(data) - 1)
    assert all(hits >= len(model.blocks) * 2 for hits in step_deltas(per_step, "prefetch_hits")[1:])
    assert step_deltas(per_step, "divergences") == [0] * len(data)


def test_the_config_section_configures_recompute(tmp_path, caplog):
    torch.manual_seed(0)
    model = Stack()
    reference = copy.deepcopy(model)
    model.recompute = {}
    data = batches(4)
    section = {"cpu_checkpointing": True, "profile": True, "partition_activations": True}
    with caplog.at_level(logging.INFO, logger="infinity"):
        engine = infinity.initialize(model, engine_config(tmp_path, "cpu",
                                                          activation_checkpointing=section))
    assert recompute.settings().cpu_checkpointing and recompute.settings().profile
    assert "partition_activations (no model-parallel ranks" in caplog.text
    losses = train_with(engine, data)
    engine.close()
    assert_parity(model, reference, losses, train_plain(reference, data))
    timings = recompute.timings()
    assert timings["calls"] == timings["recomputes"] == len(data) * len(model.blocks)


def test_a_config_without_the_section_leaves_the_settings_alone(tmp_path):
    recompute.configure(None, profile=True)
    engine = infinity.initialize(Stack(), engine_config(tmp_path, "none"))
    engine.close()
    assert recompute.settings().profile


_CHILD = r"""
import gc, json, os, sys
import torch
import infinity
sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]  # this test module and tests/ (children)
from test_engine_recompute import Stack, engine_config
def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))
peaks = {}
for mode in ("recompute", "plain"):  # the plain run second: anything the first left only lowers it
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS now
    torch.manual_seed(0)
    model = Stack(width=128, hidden=1024, depth=12, dropout=0.0)
    model.recompute = {} if mode == "recompute" else None
    engine = infinity.initialize(model, engine_config(None, "none"))
    x = torch.randn(4096, 8)
    before = {"rss": status("VmRSS"), "hwm": status("VmHWM")}
    engine.backward(engine(x).square().mean())
    engine.step()
    peaks[mode] = {**before, "peak": status("VmHWM")}
    engine.close()
    del model, engine, x
print(json.dumps(peaks))
"""


def test_recompute_lowers_the_peak_memory_of_a_step():
    """Twelve blocks whose activations (4096 rows x 1024 hidden, fp32: 16 MiB per tensor, about
    34 MiB kept per block) dominate the 13 MiB of parameters: peak RSS growth during one step,
    in one child process, its peak reset (/proc/self/clear_refs) before each run."""
    # freed tensors go back to the OS at once
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = python_child(["-c", _CHILD, os.path.dirname(__file__)], env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    plain, again = peaks["plain"], peaks["recompute"]
    plain_growth, again_growth = plain["peak"] - plain["rss"], again["peak"] - again["rss"]
    assert plain["peak"] > plain["hwm"], "the step, not initialize, sets the plain run's peak"
    assert plain_growth > 300 << 20, plain
    print(f"peak RSS growth of one step: {plain_growth >> 20} MiB without recompute, "
          f"{again_growth >> 20} MiB with")
    assert again_growth < 0.5 * plain_growth, (
        f"recompute grew RSS by {again_growth >> 20} MiB, without {plain_growth >> 20} MiB")
