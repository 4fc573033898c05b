"""infinity-train's handed-in input (config, model directory, data, a run to resume): what used
to give a traceback or be silently replaced is one line and exit 2 with nothing left in
--output; non-UTF-8 text is read with a warning that counts the bytes."""

import json
import logging
import os

import pytest

import aio
from infinity.cli import train
from infinity.train.data import read_documents

# One worker runs this module: its fixture runs once (--dist=loadgroup in pyproject.toml).
pytestmark = pytest.mark.xdist_group("train_inputs")

SMALL = ("--steps", "1", "--batch-size", "2", "--seq-len", "32")
RESUME = ("--steps", "3", "--batch-size", "2", "--seq-len", "32", "--resume")


def one_line(capsys, *args):
    code = train.main(list(args))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("infinity-train: error: "), err
    return lines[0].removeprefix("infinity-train: error: ")


def _model_with(tmp_path, tiny_hf_model, **fields):
    directory = tmp_path / "model"
    directory.mkdir()
    for item in tiny_hf_model.iterdir():
        (directory / item.name).write_bytes(item.read_bytes())
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **fields}))
    return directory


NO_BUFFERS = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu",
                                                                 "buffer_count": 0}}}
CASES = {  # case: (arguments, what the line says); {tmp} is tmp_path, {out} the --output
    "output is a file": ((), "--output {out}: exists and is not an empty directory"),
    "config not UTF-8": (("--config", "{tmp}/utf8.json"), "--config {tmp}/utf8.json: not JSON"),
    "batch size 0": (("--batch-size", "0"), "--batch-size 0: must be at least 1"),
    "micro batch 'eight'": (("--config", "{tmp}/micro.json"),
                            "train_micro_batch_size_per_gpu is 'eight'; give a whole number >= 1"),
    "buffer_count 0": (("--config", "{tmp}/buffers.json"),
                       "zero_optimization.offload_param.buffer_count = 0; allowed: an integer >= "),
    "sub_group_size 0": (("--config", "{tmp}/groups.json"),
                         "zero_optimization.sub_group_size = 0; allowed: an integer >= 1"),
    "data is a FIFO": (("--data", "{tmp}/fifo.txt"), "--data {tmp}/fifo.txt: not a regular file"),
    "architectures [5]": (("--model", "{tmp}/model"),
                          "{tmp}/model/config.json: cannot build a model from it: architectures"),
    "hidden_size 'x'": (("--model", "{tmp}/model"),
                        "no usable tokenizer (Validation error for field 'hidden_size'"),
}


def _prepare(tmp_path, tiny_hf_model, case):
    """The files `case` needs: written before the run, so the run must leave them as they are."""
    configs = {"utf8": b'{"\xff": 1}', "micro": {"train_micro_batch_size_per_gpu": "eight"},
               "buffers": NO_BUFFERS,
               "groups": {"zero_optimization": {"stage": 3, "sub_group_size": 0}}}
    for name, body in configs.items():
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        (tmp_path / f"{name}.json").write_bytes(raw)
    if case == "output is a file":
        (tmp_path / "out").write_text("keep me")
    if case == "data is a FIFO":
        os.mkfifo(tmp_path / "fifo.txt")
    if case in ("architectures [5]", "hidden_size 'x'"):
        _model_with(tmp_path, tiny_hf_model, **({"architectures": [5]} if "arch" in case
                                                else {"hidden_size": "x"}))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.timeout(120)  # a FIFO read would hang
def test_bad_input_is_one_line(tmp_path, capsys, tiny_hf_model, case):
    _prepare(tmp_path, tiny_hf_model, case)
    fill = {"tmp": tmp_path, "out": tmp_path / "out"}
    args, expect = CASES[case]
    args = [a.format(**fill) for a in args]
    if case not in ("batch size 0", "micro batch 'eight'"):  # the option would replace the config's
        args += ["--batch-size", "2"]
    before = sorted(p.name for p in tmp_path.iterdir())
    line = one_line(capsys, "--steps", "1", "--seq-len", "32", *args,
                    "--output", str(tmp_path / "out"))
    assert expect.format(**fill) in line
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    if case == "output is a file":
        assert (tmp_path / "out").read_text() == "keep me"


def test_text_that_is_not_utf8_is_read_with_a_warning(tmp_path, caplog):
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 ok \xff\xfe done")
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "bad \x80 byte"}\n')
    (tmp_path / "c.txt").write_text("all \ufffd good")  # a real U+FFFD is no bad byte
    with caplog.at_level(logging.WARNING, logger="infinity.train.data"):
        docs = list(read_documents([tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "c.txt"]))
    assert docs == ["caf\ufffd ok \ufffd\ufffd done", "fine", "bad \ufffd byte", "all \ufffd good"]
    warnings = [r.getMessage() for r in caplog.records]
    said = "are not UTF-8; each was read as U+FFFD"
    assert warnings == [f"--data {tmp_path / 'a.txt'}: 3 bytes {said}",
                        f"--data {tmp_path / 'b.jsonl'}: 1 bytes {said}"]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A run directory with one checkpoint (step 1) and its metrics."""
    run = tmp_path_factory.mktemp("saved") / "run"
    assert train.main([*SMALL, "--save-every", "1", "--output", str(run)]) == 0
    return run


def _copy(saved_run, tmp_path):
    run = tmp_path / "run"
    for path in sorted(saved_run.rglob("*")):
        target = run / path.relative_to(saved_run)
        if path.is_dir():
            target.mkdir(parents=True)
        else:
            target.write_bytes(path.read_bytes())
    (run / "checkpoints" / "latest").write_text("step1\n")
    return run


def _resign(manifest, edit):
    body = json.loads(manifest.read_text())
    del body["crc32c"]
    edit(body)
    body["crc32c"] = aio.crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    manifest.write_text(json.dumps(body))


def test_resume_refuses_a_damaged_or_foreign_checkpoint(saved_run, tmp_path, capsys):
    run = _copy(saved_run, tmp_path)
    manifest = run / "checkpoints" / "step1" / "manifest.json"
    original = manifest.read_bytes()
    manifest.write_bytes(original.replace(b'"step1"', b'"step7"', 1))  # a changed byte or two
    args = (*RESUME, "--output", str(run))
    assert one_line(capsys, *args) == (f"--resume: {manifest} does not match its checksum: the "
                                       f"manifest is damaged")
    manifest.write_bytes(original)
    _resign(manifest, lambda body: body["metadata"]["client_state"]["data"].pop("epoch"))
    assert one_line(capsys, *args) == (f"--resume: checkpoint {run / 'checkpoints' / 'step1'} has "
                                       f"no usable 'epoch' in its client_state data position: "
                                       f"damaged, or not written by infinity-train")


def test_resume_drops_a_partial_last_metrics_line(saved_run, tmp_path, capsys, caplog):
    run = _copy(saved_run, tmp_path)
    metrics = run / "metrics.jsonl"
    kept = metrics.read_text()
    with open(metrics, "a") as f:
        f.write('{"step": 2, "lo')  # the run died writing it
    with caplog.at_level(logging.WARNING, logger="infinity.train.checkpoints"):
        code = train.main([*RESUME[2:], "--steps", "2", "--output", str(run)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "its last line is partial" in caplog.text
    lines = metrics.read_text().splitlines()
    assert lines[0] == kept.strip() and [json.loads(line)["step"] for line in lines] == [1, 2]
    metrics.write_text(kept + "garbage\n" + kept)
    assert one_line(capsys, *RESUME, "--output", str(run)) == (f"--resume: {metrics}:2 is not a "
                                                               f"metrics record")
