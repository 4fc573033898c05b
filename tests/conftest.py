"""Shared test fixtures. Every test writes only under pytest's tmp_path."""

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Skip tests marked requires_cuda cleanly on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def read_only_dir():
    """A directory nobody may write into, under a parent everyone may traverse."""
    parent = tempfile.mkdtemp(prefix="infinity-test-")
    os.chmod(parent, 0o755)
    ro = os.path.join(parent, "ro")
    os.mkdir(ro)
    os.chmod(ro, 0o555)
    yield ro
    os.chmod(ro, 0o755)
    shutil.rmtree(parent)


@pytest.fixture
def run_unprivileged():
    """Run Python code in a child that drops root (root ignores file permissions).

    The code runs after `import aio, infinity` and the modules in `preload`, since nobody may
    not read root's Python installation.
    """
    def run(code: str, preload: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        prologue = (
            f"import os, sys, {', '.join(('aio', 'infinity', 'infinity.store', *preload))}\n"
            "if os.geteuid() == 0:\n    os.setgid(65534); os.setuid(65534)\n"
        )
        return subprocess.run([sys.executable, "-c", prologue + code], capture_output=True,
                              text=True, timeout=60)

    return run


@pytest.fixture
def small_tmpfs(tmp_path):
    """mount(size) -> a fresh tmpfs of `size` (e.g. "1m") under tmp_path, or None where this
    process may not mount (not root); unmounted after the test."""
    mounted = []

    def mount(size: str):
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                          capture_output=True).returncode != 0:
            return None
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=True)


def used_nbytes(directory) -> int:
    st = os.statvfs(directory)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@pytest.fixture
def sigkilled_child():
    """run(code, directory) -> (used bytes before, while alive, after SIGKILL; names left).

    `code` runs in a child that makes a swap file in `directory`, prints one line when it
    holds it, then sleeps until it is killed with SIGKILL (no handler, no atexit runs).
    Space freed by the kernel after death may show up a moment later, so "after" is polled
    until it is back at "before" (or 10 s pass).
    """
    def run(code: str, directory):
        before = used_nbytes(directory)
        child = subprocess.Popen([sys.executable, "-c", code + "\nimport time\ntime.sleep(600)\n"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = child.stdout.readline()
            alive = used_nbytes(directory)
            assert line, child.stderr.read()
        finally:
            child.kill()
            child.wait(timeout=60)
            child.stdout.close()
            child.stderr.close()
        deadline = time.monotonic() + 10
        while (after := used_nbytes(directory)) > before and time.monotonic() < deadline:
            time.sleep(0.05)
        return before, alive, after, sorted(os.listdir(directory))

    return run


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory):
    """A local Hugging Face directory as `save_pretrained` writes it: a tiny random Llama (fp32,
    untied head) and a byte-level tokenizer (256 bytes + <s>, </s>), nothing downloaded."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    directory = tmp_path_factory.mktemp("tiny-llama")
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab |= {"<s>": 256, "</s>": 257}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                         eos_token="</s>").save_pretrained(directory)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=258, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=False,
                                      bos_token_id=256, eos_token_id=257)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory
