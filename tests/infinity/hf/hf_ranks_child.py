"""One rank of test_hf_ranks.py (torchrun, 2 gloo ranks): transformers.Trainer (DDP) and
infinity.hf.Trainer (stage 3, NVMe) on the same model and data, the latter saving checkpoint-5;
rank 0 writes what the test compares to argv[1]."""

import os
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from hf_case import (  # noqa: E402
    SAVE_AT,
    STEPS,
    Tokens,
    arguments,
    base_model,
    ds_config,
    train_logs,
)

import infinity.hf  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    base = base_model()
    train, evaluation = Tokens(2 * 2 * 2 * STEPS, 1), Tokens(16, 2)
    common = {"ddp_backend": "gloo", "save_strategy": "no"}
    plain = transformers.Trainer(
        model=base_model(),
        args=arguments(str(out / "plain"), **common),
        train_dataset=train,
        eval_dataset=evaluation,
    )
    plain.train()
    plain_eval = plain.evaluate()["eval_loss"]
    nvme = str(out / "nvme")
    os.makedirs(nvme, exist_ok=True)
    ours = infinity.hf.Trainer(
        model=base,
        args=arguments(str(out / "ours"), ddp_backend="gloo", save_steps=SAVE_AT),
        train_dataset=train,
        eval_dataset=evaluation,
        config=ds_config(nvme),
    )
    ours.train()
    ours_eval = ours.evaluate()["eval_loss"]
    ours.save_model(str(out / "model"))
    x = torch.randint(0, 48, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = ours.model(x).logits
    final = dict(ours.engine.named_parameters())  # every rank: a stage-3 gather
    if int(os.environ["RANK"]) == 0:
        torch.save(
            {
                "plain": train_logs(plain),
                "ours": train_logs(ours),
                "plain_eval": plain_eval,
                "ours_eval": ours_eval,
                "x": x,
                "logits": logits,
                "final": final,
                "plain_params": dict(plain.model.named_parameters()),
            },
            out / "result.pt",
        )


if __name__ == "__main__":
    main()
