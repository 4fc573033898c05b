"""Peak RSS of models.load: a checkpoint much larger than the window streams through it.

Measured in child processes (VmHWM): the baseline child imports everything and builds the model
on meta; the loading child does the whole load into NVMe. The difference must stay under the
window, plus the store's host tier (the engine's arena, touched at start-up and used by training
anyway; bounded by host_memory_budget), plus a fixed allowance for the rest of the store (aio
handle, bookkeeping). The config keeps that sum well below the model, so a load that
materialised the model would fail."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

MiB = 1 << 20
WINDOW = 16 * MiB
ALLOWANCE = 16 * MiB  # the rest of the store (aio handle, bookkeeping) beyond the baseline child
LAYERS = 16
SHAPE = {"vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": LAYERS,
         "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 128,
         "tie_word_embeddings": False}


def write_checkpoint(directory) -> int:
    """A bf16 Llama checkpoint written tensor by tensor with safetensors (no model in memory):
    one shard per layer plus one for the embeddings; returns its bytes."""
    directory.mkdir()
    transformers.LlamaConfig(**SHAPE).save_pretrained(directory)
    h, f, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    shards = {"embed.safetensors": {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
                                    "model.norm.weight": (h,)}}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shards[f"layer{i}.safetensors"] = {
            **{p + f"self_attn.{n}_proj.weight": (h, h) for n in "qkvo"},
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    g = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for file, tensors in shards.items():
        values = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in tensors.items()}
        safetensors_torch.save_file(values, directory / file)
        total += sum(t.numel() * 2 for t in values.values())
        weight_map.update(dict.fromkeys(tensors, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total


CHILD = textwrap.dedent("""
    import json, sys
    import torch
    import infinity
    from infinity.models._meta import build_on_meta
    directory, nvme, what, window = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    config = {"train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": 3, "sub_group_size": 1 << 20,
                                    "offload_param": {"device": "nvme", "nvme_path": nvme},
                                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
              "infinity": {"host_memory_budget": "96MiB"}}
    if what == "meta":
        model = build_on_meta(directory, torch.float32)
    else:
        model = infinity.models.load(directory, config, window=window)
    placed = getattr(model, "_infinity_placed", None)
    stored = sum(u.nbytes for u in placed.layout.units) if placed else 0
    host_tier = placed.store.budgets[infinity.store.Tier.HOST] if placed else 0
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"peak": peak, "stored": stored, "host_tier": host_tier}))
""")


def run_child(directory, nvme, what) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(directory), str(nvme), what, str(WINDOW)],
                         capture_output=True, text=True, timeout=240, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_peak_rss_of_a_load_is_the_window_not_the_model(tmp_path):
    checkpoint_nbytes = write_checkpoint(tmp_path / "ckpt")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    baseline = run_child(tmp_path / "ckpt", nvme, "meta")
    loaded = run_child(tmp_path / "ckpt", nvme, "load")
    assert loaded["stored"] == 2 * checkpoint_nbytes  # bf16 shards became fp32 parameters
    growth = loaded["peak"] - baseline["peak"]
    bound = WINDOW + loaded["host_tier"] + ALLOWANCE
    print(f"checkpoint {checkpoint_nbytes / MiB:.0f} MiB (bf16) -> {loaded['stored'] / MiB:.0f} MiB fp32 in the "
          f"store; peak RSS {baseline['peak'] / MiB:.0f} MiB building on meta, {loaded['peak'] / MiB:.0f} MiB "
          f"loading with a {WINDOW / MiB:.0f} MiB window and a {loaded['host_tier'] / MiB:.0f} MiB host tier "
          f"(+{growth / MiB:.1f} MiB, bound {bound / MiB:.0f} MiB)")
    assert bound < loaded["stored"]  # the test can tell a streamed load from a materialised one
    assert growth < bound
