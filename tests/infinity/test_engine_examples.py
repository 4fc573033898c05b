"""The ZeRO-Infinity example configs of DeepSpeed's and Hugging Face's docs train unchanged.

tests/infinity/config/test_config_examples.py checks what each file means; here each one
drives `infinity.initialize` on a small transformers model for three optimizer steps (their
micro-batches and accumulation as the file says, or from the first batch where it says
"auto"). Edits at test time, each what a user of the docs does too: NVME_PATH becomes a
directory under tmp_path, and a WarmupDecayLR's "auto" total_num_steps gets the number of
steps (the Hugging Face Trainer fills it from its arguments).
"""

import json
import pathlib

import pytest
import torch
import transformers

import infinity

EXAMPLES = pathlib.Path(__file__).parent / "config" / "examples"  # test_config_examples.py's
STEPS = 3  # a WarmupLR of the docs updates at lr 0 twice (min lr, then log(1) of the warmup)


def _tiny_llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def _example(name: str, tmp_path) -> dict:
    text = (EXAMPLES / name).read_text().replace("NVME_PATH", str(tmp_path / "nvme"))
    (tmp_path / "nvme").mkdir()
    config = json.loads(text)
    schedule = config.get("scheduler", {})
    if (schedule.get("type") == "WarmupDecayLR"
            and schedule["params"].get("total_num_steps") == "auto"):
        schedule["params"]["total_num_steps"] = STEPS
    return config


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.json")))
def test_every_example_trains(name, tmp_path, train_lm):
    model = _tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = infinity.initialize(model, _example(name, tmp_path))
    micro = engine.config.train_micro_batch_size_per_gpu or 2  # "auto": the first batch decides
    g = torch.Generator().manual_seed(1)
    micro_steps = STEPS * engine.config.gradient_accumulation_steps
    losses = train_lm(engine, [torch.randint(0, 64, (micro, 8), generator=g)
                               for _ in range(micro_steps)])
    assert engine.global_steps == STEPS
    assert engine.skipped_steps == 0  # every step applied: no fp16 overflow at these values
    if engine.config.fp16.enabled:  # so the dynamic scale stayed (a window of 1000 steps)
        assert engine.stats()["loss_scale"] == 2.0 ** engine.config.fp16.initial_scale_power
    engine.close()
    assert all(torch.isfinite(torch.tensor(losses))), losses
    changed = [n for n, p in model.named_parameters()
               if not torch.equal(p.detach().float(), before[n].float())]
    assert changed, "no parameter changed"
