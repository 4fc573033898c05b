"""A DeepSpeed getting-started-style training script whose only change is its import line
(`import deepspeed` -> `import infinity.deepspeed as deepspeed`): argparse with DeepSpeed's
flags, a client AdamW with decay / no-decay groups and a LambdaLR, `training_data=`, a
checkpoint at step --save-at, `load_checkpoint` when --resume, `save_16bit_model` at the end.

Run by tests/infinity/deepspeed/test_deepspeed_script.py, which also imports `Net`, `dataset`,
`param_groups` and `warmup_then_decay` for the plain PyTorch reference. Writes `--out`:
{"losses": {micro_step: loss}, "lrs": {step: lr}} and `<out>.pt` (the final parameters).
"""

import argparse
import json

import torch

import infinity.deepspeed as deepspeed

STEPS = 6


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(12, 24)
        self.norm = torch.nn.LayerNorm(24)
        self.hidden = torch.nn.Linear(24, 24)
        self.head = torch.nn.Linear(24, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.hidden(self.norm(self.embed(x))))
        return torch.nn.functional.cross_entropy(self.head(h), y)


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(
        torch.randn(40, 12, generator=g), torch.randint(0, 3, (40,), generator=g)
    )


def param_groups(net: torch.nn.Module) -> list[dict]:
    decay = [
        p for n, p in net.named_parameters() if n.endswith("weight") and not n.startswith("norm")
    ]
    rest = [
        p
        for n, p in net.named_parameters()
        if not (n.endswith("weight") and not n.startswith("norm"))
    ]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def warmup_then_decay(step: int) -> float:
    return min(1.0, (step + 1) / 3) * max(0.0, 1.0 - step / (STEPS + 2))


def main() -> None:
    parser = argparse.ArgumentParser(description="getting started")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(0)
    net = Net()
    optimizer = torch.optim.AdamW(param_groups(net), lr=2e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay)
    engine, optimizer, trainloader, scheduler = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=net.parameters(),
        optimizer=optimizer,
        lr_scheduler=scheduler,
        training_data=dataset(),
    )

    done = 0  # micro-batches trained
    if args.resume:
        _, client_state = engine.load_checkpoint(args.save_dir)
        done = client_state["micro_steps"]
    losses, lrs = {}, {}
    micro = 0
    while engine.global_steps < STEPS:
        for x, y in trainloader:
            if micro < done:  # the order repeats in a fresh process: skip what the checkpoint holds
                micro += 1
                continue
            loss = engine(x, y)
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary():
                lrs[engine.global_steps + 1] = engine.get_lr()[0]
            engine.step()
            losses[micro] = loss.item()
            micro += 1
            if micro % engine.gradient_accumulation_steps() == 0:  # an update was applied
                if engine.global_steps == args.save_at and not args.resume:
                    engine.save_checkpoint(args.save_dir, client_state={"micro_steps": micro})
                if engine.global_steps == STEPS:
                    break
    engine.save_16bit_model(args.save_dir)
    with open(args.out, "w") as out:
        json.dump({"losses": losses, "lrs": lrs}, out)
    torch.save(dict(engine.named_parameters()), args.out + ".pt")


if __name__ == "__main__":
    main()
