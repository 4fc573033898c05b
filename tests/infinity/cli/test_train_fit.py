"""Defaults that fit the machine (issue 19): a model of vocabulary 32000 from
infinity-make-model trains with no --config (the old shipped 256 MB budget refused it: three
whole-embedding optimizer tiles of sub_group_size 1e9); through infinity.models.load +
initialize a 256 MiB budget trains with the tiles the plan picks, and a budget no plan fits is
refused naming the least budget, at which the model trains."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

import infinity
from infinity.cli import make_model
from infinity.errors import BudgetError
from infinity.store import Tier
from infinity.train.models import DEFAULTS

# One worker runs this module: its fixture runs once (--dist=loadgroup in pyproject.toml).
pytestmark = pytest.mark.xdist_group("train_fit")

ROOT = str(pathlib.Path(__file__).resolve().parents[3])
MIB = 1 << 20


def make(directory, hidden):
    assert make_model.main([str(directory), "--layers", "1", "--hidden", str(hidden),
                            "--intermediate", str(hidden), "--heads", "8", "--kv-heads", "4",
                            "--vocab", "32000"]) == 0
    return directory


@pytest.fixture(scope="module")
def wide_vocab(tmp_path_factory):
    """An embedding (and output head) of 16.4 M elements: 65.5 MB in fp32 each."""
    return make(tmp_path_factory.mktemp("models") / "llama-32k", 512)


def config(nvme, budget):
    config = json.loads((DEFAULTS / "ds_config.json").read_text())
    for key in ("offload_param", "offload_optimizer"):
        config["zero_optimization"][key]["nvme_path"] = str(nvme)
    config["infinity"]["host_memory_budget"] = budget
    config["train_micro_batch_size_per_gpu"] = 1
    return config


def train_one_step(model_dir, config):
    model = infinity.models.load(model_dir, config)
    with infinity.initialize(model, config) as engine:
        ids = torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(0))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return engine.plan, loss.item()


def test_a_vocab_32000_model_trains_with_no_config(tmp_path, wide_vocab):
    installed = shutil.which("infinity-train")
    command = [installed] if installed else [sys.executable, "-m", "infinity.cli.train"]
    done = subprocess.run([*command, "--model", str(wide_vocab), "--steps", "2", "--seq-len",
                           "32", "--batch-size", "1", "--nvme-path", str(tmp_path), "--output",
                           str(tmp_path / "out")], env={**os.environ, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "steps         2 of 2" in done.stdout
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_a_256_mib_budget_trains_with_the_tiles_the_plan_picks(tmp_path, caplog):
    model_dir = make(tmp_path / "llama", 256)  # 8.2 M-element embedding: whole tiles of 98 MB
    with caplog.at_level("INFO", logger="infinity.engine._plan"):
        plan, loss = train_one_step(model_dir, config(tmp_path, 256 * MIB))
    assert plan.tile_numel < 32000 * 256  # not three whole-embedding tiles (295 MB)
    assert plan.budgets[Tier.HOST] + plan.outside_store_nbytes <= 256 * MIB
    chose = f"optimizer tiles of {plan.tile_numel} elements (sub_group_size 1000000000"
    assert chose in caplog.text
    assert loss == loss  # a real loss: the step ran


def test_a_budget_no_plan_fits_names_the_least_that_trains(tmp_path, wide_vocab):
    with pytest.raises(BudgetError) as refused:
        infinity.models.load(wide_vocab, config(tmp_path, 256 * MIB))
    message = str(refused.value)
    assert "set infinity.host_memory_budget to at least" in message
    least = int(re.search(r"it needs at least (\d+) bytes", message).group(1))
    assert 256 * MIB < least < 512 * MIB
    plan, loss = train_one_step(wide_vocab, config(tmp_path, least))
    assert plan.min_host_budget == least and loss == loss
