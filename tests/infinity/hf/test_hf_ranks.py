"""infinity.hf.Trainer under torchrun, 2 gloo ranks, ZeRO stage 3 with parameters and optimizer
state on NVMe, against transformers.Trainer (DDP) on the same model and data: every logged loss
and grad norm within 1e-5 relative, the same learning rates and eval_loss; save_model() loads
with from_pretrained and gives the model's logits; checkpoint-5 is saved by both ranks (the
engine's save is a collective). Resuming from it is test_hf_trainer.py's, on one process: the
engine's checkpoints on several ranks are test_ranks_checkpoint.py's. One torchrun launch runs it
all (hf_ranks_child.py)."""

import os
import sys
from pathlib import Path

import pytest
import torch
import transformers
from children import python_child, torchrun

from infinity.checkpoint import latest_tag

sys.path.insert(0, str(Path(__file__).parent))
from hf_case import SAVE_AT, STEPS  # noqa: E402

CHILD = Path(__file__).parent / "hf_ranks_child.py"


def test_the_trainer_on_two_ranks_at_stage_3(tmp_path):
    command = [*torchrun(2), str(CHILD), str(tmp_path)]
    run = python_child(
        command, env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}, timeout=900
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    result = torch.load(tmp_path / "result.pt")
    plain, ours = result["plain"], result["ours"]
    assert [e["step"] for e in ours] == [e["step"] for e in plain] == list(range(1, STEPS + 1))
    for e, g in zip(plain, ours):
        assert abs(g["loss"] - e["loss"]) <= 1e-5 * abs(e["loss"]), (e, g)
        assert abs(g["grad_norm"] - float(e["grad_norm"])) <= 1e-5 * float(e["grad_norm"]), (e, g)
        assert g["learning_rate"] == pytest.approx(e["learning_rate"], rel=1e-12)
    assert abs(result["ours_eval"] - result["plain_eval"]) <= 1e-5 * result["plain_eval"]
    for name, p in result["plain_params"].items():
        torch.testing.assert_close(result["final"][name], p.detach(), rtol=1e-4, atol=1e-5)

    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "model")
    with torch.no_grad():
        assert torch.equal(loaded(result["x"]).logits, result["logits"])

    checkpoint = tmp_path / "ours" / f"checkpoint-{SAVE_AT}"  # committed: 'latest' names it
    assert latest_tag(checkpoint) == f"global_step{SAVE_AT}"
