"""infinity-convert: every output format from Infinity and DeepSpeed checkpoints, the Hugging
Face round trip through from_pretrained, bad input (exit 2, one line, nothing left), and peak
memory bounded by --max-shard-size."""

import json
import os

import deepspeed_layout
import pytest
import torch
import zarr
from children import python_child
from safetensors.torch import load_file

from infinity.checkpoint import CheckpointReader, CheckpointWriter
from infinity.cli.convert import main

MiB = 1 << 20


def _params():
    g = torch.Generator().manual_seed(1)
    return {"embed.weight": torch.randn(11, 6, generator=g),
            "fc.weight": torch.randn(6, 6, generator=g),
            "fc.bias": torch.randn(6, generator=g)}


def _read_output(directory, fmt):
    """Every tensor of a converted output, by name."""
    if fmt in ("hf", "safetensors"):
        return {k: v for f in sorted(directory.glob("*.safetensors"))
                for k, v in load_file(f).items()}
    if fmt == "torch":
        return {k: v for f in sorted(directory.glob("*.bin"))
                for k, v in torch.load(f, weights_only=True).items()}
    if fmt == "zarr":
        group = zarr.open_group(str(directory), mode="r")
        out = {}
        for name, array in group.members(max_depth=None):
            if isinstance(array, zarr.Array):
                data = torch.from_numpy(array[...])
                out[name] = (data.view(torch.bfloat16) if array.attrs["dtype"] == "bfloat16"
                             else data)
        return out
    reader = CheckpointReader(directory)
    return {name: reader.read(name) for name in reader.names()}


@pytest.mark.parametrize("fmt", ["hf", "safetensors", "torch", "zarr", "infinity"])
@pytest.mark.parametrize("stage", [2, 3])
def test_a_deepspeed_checkpoint_converts_to_every_format(tmp_path, fmt, stage, capsys):
    expected = deepspeed_layout.write(tmp_path / "ds", _params(), stage=stage,
                                      buffers={"ids": torch.arange(4)},
                                      shared={"head.weight": "embed.weight"})
    (tmp_path / "ds" / "config.json").write_text(json.dumps({"model_type": "toy"}))
    args = [str(tmp_path / "ds"), str(tmp_path / "out"), "--to", fmt, "--max-shard-size", "300"]
    assert main(args) == 0
    got = _read_output(tmp_path / "out", fmt)
    if fmt in ("hf", "safetensors", "torch"):
        expected = {k: v for k, v in expected.items() if "/" not in k}
        # 300-byte shards of the five tensors: three shards (embed.weight's 264 bytes alone)
        stem, ext = ("pytorch_model", ".bin") if fmt == "torch" else ("model", ".safetensors")
        files = [f"{stem}-0000{i}-of-00003{ext}" for i in (1, 2, 3)] + [f"{stem}{ext}.index.json"]
        files += ["config.json"] if fmt == "hf" else []
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(files)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name].reshape(tensor.shape),
                                                               tensor), name
    assert (fmt == "hf") == (tmp_path / "out" / "config.json").is_file()
    assert "verified against the source" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "out"], "no temporary left"


def test_dtype_casts_the_weights_only(tmp_path):
    expected = deepspeed_layout.write(tmp_path / "ds", _params(), stage=3,
                                      buffers={"ids": torch.arange(4)})
    assert main([str(tmp_path / "ds"), str(tmp_path / "out"), "--to", "infinity",
                 "--dtype", "bf16"]) == 0
    got = _read_output(tmp_path / "out", "infinity")
    assert got["fc.weight"].dtype == torch.bfloat16 and torch.equal(got["fc.weight"],
                                                                    expected["fc.weight"].bfloat16())
    assert got["ids"].dtype == torch.int64, "integers are not cast"
    assert got["exp_avg/fc.weight"].dtype == torch.float32, "optimizer moments keep their precision"
    reader = CheckpointReader(tmp_path / "out")
    assert reader.tag == "global_step7" and reader.metadata["zero_stage"] == 3


def test_an_infinity_checkpoint_converts_and_keeps_its_model_config(tmp_path):
    params = _params()
    with CheckpointWriter(tmp_path / "run", "step3",
                          metadata={"model_config": {"model_type": "toy"}}) as writer:
        for name, tensor in params.items():
            writer.add(name, tensor)
        writer.add("exp_avg/fc.bias", torch.ones(6))
    assert main([str(tmp_path / "run"), str(tmp_path / "out"), "--to", "hf",
                 "--dtype", "fp16"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())  # says what was written
    assert config == {"model_type": "toy", "dtype": "float16", "torch_dtype": "float16"}
    got = _read_output(tmp_path / "out", "hf")
    assert sorted(got) == sorted(params)
    assert all(torch.equal(got[k], v.half()) for k, v in params.items())


def test_a_transformers_model_through_deepspeed_and_hf_gives_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    config.save_pretrained(tmp_path / "config")
    params = {n: p.detach().clone() for n, p in model.named_parameters()}  # ties appear once
    deepspeed_layout.write(tmp_path / "ds", params, stage=3, world_size=2, sub_group_numel=500,
                           shared={"lm_head.weight": "model.embed_tokens.weight"})
    assert main([str(tmp_path / "ds"), str(tmp_path / "hf"), "--to", "hf", "--model-config",
                 str(tmp_path / "config"), "--max-shard-size", "8K"]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def _bad_deepspeed(tmp_path, damage):
    deepspeed_layout.write(tmp_path / "ds", _params(), stage=3, world_size=2)
    tag = tmp_path / "ds" / "global_step7"
    if damage == "missing rank":
        (tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    else:
        path = tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
        os.truncate(path, path.stat().st_size - 100)
    return tmp_path / "ds"


def _bad_infinity(tmp_path, damage):
    with CheckpointWriter(tmp_path / "run", "step1") as writer:
        writer.add("w", torch.randn(1000))
    manifest = tmp_path / "run" / "step1" / "manifest.json"
    body = json.loads(manifest.read_text())
    if damage == "version":
        body["version"] = 7
        manifest.write_text(json.dumps(body))
    else:
        chunk = tmp_path / "run" / "step1" / body["tensors"][0]["array"] / "c" / "0"
        chunk.write_bytes(chunk.read_bytes()[:-8])
    return tmp_path / "run"


@pytest.mark.parametrize("case, complaint", [
    ("not a checkpoint", "is neither an Infinity checkpoint"),
    ("missing rank", "missing rank file(s) ['bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt']"),
    ("truncated", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt is truncated"),
    ("version", "format version 7; this Infinity reads version 1"),
    ("truncated chunk", "tensor 'w': chunk file"),
    ("no model config", "--to hf needs the model's config.json"),
    ("destination exists", "exists; give a new output path"),
    ("missing parent", "does not exist; create it first"),
])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path, capsys, case, complaint):
    if case == "not a checkpoint":
        (tmp_path / "src").mkdir()
        (tmp_path / "src" / "weights.bin").write_bytes(b"x")
        src = tmp_path / "src"
    elif case in ("missing rank", "truncated"):
        src = _bad_deepspeed(tmp_path, case)
    elif case in ("version", "truncated chunk"):
        src = _bad_infinity(tmp_path, case)
    else:
        deepspeed_layout.write(tmp_path / "ds", _params(), stage=3)
        src = tmp_path / "ds"
    if case == "destination exists":
        (tmp_path / "out").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    out = tmp_path / "nowhere" / "out" if case == "missing parent" else tmp_path / "out"
    assert main([str(src), str(out),
                 "--to", "hf" if case == "no model config" else "safetensors"]) == 2
    err = capsys.readouterr().err
    assert (err.count("\n") == 1 and err.startswith("infinity-convert: error: ")
            and complaint in err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_help_shows_examples_and_defaults(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "infinity-convert ds_ckpt/ out/llama-hf --to hf" in out and "(default: 5G)" in out


PEAK_CHILD = r"""
import sys
from infinity.cli.convert import main
def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak RSS (VmHWM) to what the imports hold
base = kib("VmRSS")
assert main(sys.argv[1:]) == 0
print("GROWN", (kib("VmHWM") - base) * 1024)
"""
SHARD = 16 * MiB
# What a conversion holds besides shard data: one source chunk being cast (4 MiB tensors here),
# the tensor being verified, zarr's and safetensors' per-file state, the allocator's slack.
# Measured growth in all: 14 MiB (safetensors, which streams: no shard is ever held) and
# 26-28 MiB (torch: one 16 MiB shard, one 4 MiB tensor being joined, 6-8 MiB besides) on the
# development machine; allowed on top of 2 shards: 16 MiB.
OVERHEAD = 16 * MiB


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_peak_memory_is_bounded_by_the_shard_size_not_the_checkpoint(tmp_path, fmt):
    with CheckpointWriter(tmp_path / "run", "big") as writer:  # 64 MiB: 4x the shard size
        for i in range(16):
            writer.add(f"layer{i}.weight", torch.full((1 << 20,), float(i)))
    out = python_child(["-c", PEAK_CHILD, str(tmp_path / "run"), str(tmp_path / "out"),
                        "--to", fmt, "--max-shard-size", "16M"], timeout=120)
    assert out.returncode == 0, out.stderr
    grown = int(out.stdout.split("GROWN")[1])
    assert len(list((tmp_path / "out").glob("*-of-00004*"))) == 4
    assert grown < 2 * SHARD + OVERHEAD, f"peak RSS grew by {grown / MiB:.1f} MiB converting 64 MiB"


def test_an_infinity_train_run_converts_to_hf_in_bf16_with_its_tokenizer(tmp_path, capsys):
    """The run folder itself is a source (its checkpoints/latest); --dtype bf16 writes a
    config.json that says bfloat16, and the run's tokenizer files come along."""
    transformers = pytest.importorskip("transformers")
    from infinity.cli import train

    run = tmp_path / "run"
    assert train.main(["--steps", "1", "--batch-size", "2", "--seq-len", "32", "--save-every", "1",
                       "--output", str(run)]) == 0
    capsys.readouterr()
    assert main([str(run), str(tmp_path / "hf"), "--to", "hf", "--dtype", "bf16"]) == 0, \
        capsys.readouterr().err
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert next(model.parameters()).dtype == torch.bfloat16
    exported = load_file(run / "model-00001-of-00001.safetensors")  # what the run exported
    for name, values in model.state_dict().items():
        if name in exported:
            assert torch.equal(values, exported[name].to(torch.bfloat16)), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.encode("hé", add_special_tokens=False) == list("hé".encode())
