"""A DeepSpeed getting-started-style script (getting_started.py) that changes only its import
trains on Infinity: fp32, parameters and optimizer state on NVMe, a client AdamW with decay /
no-decay groups and a LambdaLR warmup-then-decay, accumulation 2, clipping 1.0: every loss
equals plain PyTorch (AdamW, the same scheduler and clipping) to 1e-5 relative; a fresh process
resuming from the step-3 checkpoint ends bit-identical to the uninterrupted run; the 16-bit
model loads into the original module class. The uninterrupted run is the test's own process (a
process costs ~15 s of imports on a busy machine), the resumed one a fresh process."""

import json
import os
import sys
from pathlib import Path

import torch
from children import python_child

sys.path.insert(0, str(Path(__file__).parent))
import getting_started  # noqa: E402
from getting_started import STEPS, Net, dataset, param_groups, warmup_then_decay  # noqa: E402

SCRIPT = Path(__file__).parent / "getting_started.py"
MICRO, GAS = 4, 2


def _config(tmp_path: Path) -> Path:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    offload = {"device": "nvme", "nvme_path": str(nvme)}
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "sub_group_size": 256,
            "offload_param": offload,
            "offload_optimizer": offload,
        },
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return path


def _arguments(tmp_path: Path, config: Path, out: str, *extra: str) -> list[str]:
    return [
        "--deepspeed",
        "--deepspeed_config",
        str(config),
        "--save-dir",
        str(tmp_path / "ckpt"),
        "--out",
        str(tmp_path / out),
        *extra,
    ]


def _run_here(monkeypatch, tmp_path: Path, config: Path, out: str) -> dict:
    """The script's main() in this process, on one thread as the fresh process runs; its
    engine is closed after."""
    engines = []

    def initialize(*args, **kwargs):
        engines.append(deepspeed_initialize(*args, **kwargs))
        return engines[-1]

    deepspeed_initialize = getting_started.deepspeed.initialize
    monkeypatch.setattr(getting_started.deepspeed, "initialize", initialize)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *_arguments(tmp_path, config, out)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        getting_started.main()
    finally:
        torch.set_num_threads(threads)
        for engine, *_ in engines:
            engine.close()
    return _result(tmp_path, out)


def _run_fresh(tmp_path: Path, config: Path, out: str, *extra: str) -> dict:
    run = python_child(
        [str(SCRIPT), *_arguments(tmp_path, config, out, *extra)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert run.returncode == 0 and (tmp_path / out).is_file(), (
        run.stdout[-2000:] + run.stderr[-3000:]
    )
    return _result(tmp_path, out)


def _result(tmp_path: Path, out: str) -> dict:
    result = json.loads((tmp_path / out).read_text())
    result["losses"] = {int(k): v for k, v in result["losses"].items()}
    result["lrs"] = {int(k): v for k, v in result["lrs"].items()}
    result["params"] = torch.load(tmp_path / (out + ".pt"))
    return result


def _plain_pytorch() -> tuple[dict[int, float], dict[int, float], torch.nn.Module]:
    """The same script in plain PyTorch: the loader's order (DistributedSampler, seed 0), AdamW,
    the scheduler, clipping 1.0, loss / 2 per micro-batch."""
    torch.manual_seed(0)
    net = Net()
    optimizer = torch.optim.AdamW(param_groups(net), lr=2e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay)
    data = dataset()
    order = list(torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0))
    batches = [data[order[i : i + MICRO]] for i in range(0, len(order), MICRO)]
    losses, lrs = {}, {}
    for micro in range(STEPS * GAS):
        x, y = batches[micro % len(batches)]
        loss = net(x, y)
        (loss / GAS).backward()
        losses[micro] = loss.item()
        if micro % GAS == GAS - 1:
            lrs[micro // GAS + 1] = optimizer.param_groups[0]["lr"]
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return losses, lrs, net


def test_a_deepspeed_script_trains_resumes_and_saves_unchanged(tmp_path, monkeypatch):
    config = _config(tmp_path)
    whole = _run_here(monkeypatch, tmp_path, config, "whole.json")
    resumed = _run_fresh(tmp_path, config, "resumed.json", "--resume")
    losses, lrs, net = _plain_pytorch()

    assert sorted(whole["losses"]) == list(range(STEPS * GAS))
    for micro, loss in losses.items():
        assert abs(whole["losses"][micro] - loss) <= 1e-5 * abs(loss), (
            micro,
            whole["losses"][micro],
            loss,
        )
    assert whole["lrs"] == lrs  # every update ran at the client scheduler's learning rate
    for name, p in net.named_parameters():
        torch.testing.assert_close(whole["params"][name], p.detach(), rtol=1e-5, atol=1e-6)

    # The fresh process trained micro-batches 6.. from the step-3 checkpoint, exactly as the
    # whole run did.
    assert sorted(resumed["losses"]) == list(range(3 * GAS, STEPS * GAS))
    assert all(resumed["losses"][m] == whole["losses"][m] for m in resumed["losses"])
    assert all(torch.equal(resumed["params"][n], whole["params"][n]) for n in whole["params"])

    saved = torch.load(tmp_path / "ckpt" / "pytorch_model.bin", weights_only=True)
    model = Net()
    model.load_state_dict(saved)  # strict: every key of the original module class
    assert all(torch.equal(p, resumed["params"][n]) for n, p in model.named_parameters())
