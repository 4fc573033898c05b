"""Shared test fixtures. Every test writes only under pytest's tmp_path.

The terminal summary says which native paths this run exercised: each ISA of the Adam kernel,
each aio backend and the CUDA paths, and which this machine could not run (tests of those are
skipped, saying why).
"""

import collections
import errno
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

# What importing infinity before torch does ([Note: threads that wait] in infinity/__init__.py):
# torch's OpenMP threads sleep when they wait instead of spinning on the cores the optimizer
# worker, the I/O threads and the children of the tests need. test_threads.py sets its own.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
from children import ROOT, child_env

# test parameter name (or "cuda" for tests marked requires_cuda) -> what it selects
NATIVE_PATHS = {
    "isa": "Adam kernel ISA",
    "backend": "aio backend",
    "cuda": "CUDA paths (requires_cuda)",
}
_RUNS = pytest.StashKey[dict]()
_PATHS = "native paths"  # the user property a report names its native paths in
_CONFIG: pytest.Config  # set by pytest_configure; logreport hooks get no config


def _choices() -> dict[str, dict[str, str | None]]:
    """For each tracked parameter: every choice -> None if this machine runs it, else why not.

    Imported here, not at the top, so a broken native build fails tests, not pytest's start."""
    from aio._native import probe
    from aio.handle import BACKENDS
    from infinity.optim import available_isas
    from infinity.optim._native import ISAS

    isas = {isa: None if isa in available_isas() else "not supported by this CPU"
            for isa in ISAS if isa != "auto"}
    probes = {backend: probe(backend) for backend in BACKENDS}
    backends = {b: None if ret == 0 else f"unavailable here ({os.strerror(-ret)})"
                for b, ret in probes.items()}
    cuda = {"device": None if torch.cuda.is_available() else "not present"}
    return {"isa": isas, "backend": backends, "cuda": cuda}


def pytest_configure(config):
    config.stash[_RUNS] = {name: collections.defaultdict(collections.Counter)
                          for name in NATIVE_PATHS}
    global _CONFIG
    _CONFIG = config


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook (a dev dependency: addopts names --dist)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the README's test command): a worker a core, at most four; each imports torch
    and most tests are one core's work, so more buy little and cost memory."""
    return max(1, min(os.cpu_count() or 1, 4))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Note on the report which native paths the test selects (pytest-xdist carries reports,
    not items, from its workers to the process that prints the summary)."""
    report = (yield).get_result()
    params = dict(getattr(getattr(item, "callspec", None), "params", {}))
    if "requires_cuda" in item.keywords:
        params["cuda"] = "device"
    paths = {name: str(params[name]) for name in NATIVE_PATHS if name in params}
    if paths:
        report.user_properties.append((_PATHS, paths))


def pytest_runtest_logreport(report):
    """Count outcomes per ISA / backend / CUDA: a skip or error at setup, else the call's."""
    paths = dict(report.user_properties).get(_PATHS)
    if paths and (report.when == "call" or (report.when == "setup" and not report.passed)):
        for name, choice in paths.items():
            _CONFIG.stash[_RUNS][name][choice][report.outcome] += 1


def pytest_terminal_summary(terminalreporter, config):
    """One line per native path family: what ran, what was skipped and why."""
    terminalreporter.section("native paths exercised")
    try:
        import aio
        from infinity.optim import resolve_isa

        all_choices = _choices()
    except ImportError as exc:  # a broken build: the failed tests say the rest
        terminalreporter.write_line(f"native modules not importable: {exc}")
        return
    for name, choices in all_choices.items():
        runs = config.stash[_RUNS][name]
        parts = []
        for choice, missing in choices.items():
            counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(runs[choice].items()))
            if missing:
                parts.append(f"{choice} {missing} ({counts or 'no test'})")
            elif runs[choice]["passed"] or runs[choice]["failed"]:
                parts.append(f"{choice} ran ({counts})")
            else:
                parts.append(f"{choice} not exercised by this run")
        terminalreporter.write_line(f"{NATIVE_PATHS[name]}: " + "; ".join(parts))
    terminalreporter.write_line(f"Adam kernel 'auto' picks {resolve_isa('auto')}; aio backend "
                                f"'auto' picks {aio.available_backends()[0]}")


def pytest_collection_modifyitems(config, items):
    """Skip tests marked requires_cuda cleanly on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)


def _train_lm(engine, batches) -> list[float]:
    losses = []
    for ids in batches:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.fixture
def train_lm():
    """train_lm(engine, batches) -> losses: one forward (labels = the input ids), backward and
    step per batch of token ids, as a causal LM trains."""
    return _train_lm


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


@pytest.fixture(scope="session")
def readable_packages():
    """A copy of this checkout's packages that every user may read, under a parent everyone may
    traverse: a child that dropped root reads its modules and package data there, whatever
    the mode of the checkout's folder (a root user's home is 0700)."""
    root = tempfile.mkdtemp(prefix="infinity-test-packages-")
    for package in ("aio", "infinity"):
        shutil.copytree(ROOT / package, os.path.join(root, package),
                        ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["chmod", "-R", "a+rX", root], check=True)
    yield root
    shutil.rmtree(root)


# Imported by the unprivileged server before it drops root: nobody may read root's Python
# installation, so what the snippets use must be loaded already (the union of their needs).
_UNPRIVILEGED_PRELOAD = ("aio", "infinity", "infinity.store", "infinity.checkpoint",
                         "infinity.cli.nvme_bench", "infinity.cli.train", "torch", "zarr",
                         "tokenizers", "transformers.models.llama.modeling_llama",
                         "transformers.tokenization_utils_tokenizers")

# Reads one request a line: {"code", "stdout", "stderr"}; runs the code in a fork of itself
# (the imports done once), which drops root and writes its output to those files; answers the
# fork's exit status, as a child process's return code.
_UNPRIVILEGED_SERVER = r"""
import importlib, json, os, sys, traceback
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
print("ready", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY), fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        status = 0
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            exec(compile(request["code"], "<unprivileged>", "exec"), {"__name__": "__main__"})
        except SystemExit as exc:
            if isinstance(exc.code, int) or exc.code is None:
                status = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                status = 1
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    _, wait_status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(wait_status), flush=True)
"""


@pytest.fixture(scope="session")
def _unprivileged_server(readable_packages):
    """One child that imports our packages (from `readable_packages`) and torch, transformers
    once, and forks a fresh copy of itself for each snippet run_unprivileged runs."""
    server = subprocess.Popen([sys.executable, "-c", _UNPRIVILEGED_SERVER,
                               json.dumps(_UNPRIVILEGED_PRELOAD)], cwd=readable_packages,
                              env={**os.environ, "PYTHONPATH": str(readable_packages)},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert _answer(server, 300) == "ready"
        yield server
    finally:
        server.stdin.close()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        server.stdout.close()


def _answer(server: subprocess.Popen, timeout: float) -> str:
    if not select.select([server.stdout], [], [], timeout)[0]:
        server.kill()
        raise subprocess.TimeoutExpired("unprivileged server", timeout)
    line = server.stdout.readline()
    assert line, f"the unprivileged server exited ({server.wait()})"
    return line.strip()


@pytest.fixture
def run_unprivileged(_unprivileged_server, readable_packages):
    """Run Python code as a user that is not root (root ignores file permissions): in a fork of
    a child that dropped root there (nothing done if the tests do not run as root).

    The code runs after `import os, sys` and the modules in _UNPRIVILEGED_PRELOAD (user nobody
    may not read root's Python installation); our packages come from `readable_packages`.
    `preload` names modules the code needs beyond the others: each must be in the list.
    """
    server = _unprivileged_server

    def run(code: str, preload: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        assert set(preload) <= set(_UNPRIVILEGED_PRELOAD), "add it to _UNPRIVILEGED_PRELOAD"
        output = tempfile.mkdtemp(prefix="unprivileged-", dir=readable_packages)
        paths = {name: os.path.join(output, name) for name in ("stdout", "stderr")}
        for path in paths.values():
            open(path, "w").close()
        prologue = f"import os, sys, {', '.join(_UNPRIVILEGED_PRELOAD)}\n"
        server.stdin.write(json.dumps({"code": prologue + code, **paths}) + "\n")
        server.stdin.flush()
        returncode = int(_answer(server, 300))
        out, err = (open(path).read() for path in paths.values())
        shutil.rmtree(output)
        return subprocess.CompletedProcess(["<unprivileged>"], returncode, out, err)

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
            point.rmdir()
            return None
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=True)


@pytest.fixture
def small_disk(small_tmpfs, tmp_path, monkeypatch):
    """small_disk(size) -> a directory on a disk of `size` (e.g. "4m"), where ENOSPC comes as
    on a full disk: a private tmpfs where this process may mount (the kernel's), else a
    directory under tmp_path whose files may not grow past `size` in all (injected where a
    swap file is preallocated and where a checkpoint chunk is written, as fallocate and write
    fail on a full disk). The injected disk shows neither the unlinked swap files as used
    space nor its size to statvfs."""
    made = []

    def make(size: str):
        mounted = small_tmpfs(size)
        if mounted is not None:
            return mounted
        import zarr.storage

        directory = tmp_path / f"disk{len(made)}"
        directory.mkdir()
        made.append(directory)
        limit = int(size[:-1]) << {"k": 10, "m": 20}[size[-1].lower()]

        def check(path: str, nbytes: int) -> None:
            if path.startswith(f"{directory}{os.sep}"):
                used = sum(os.path.getsize(os.path.join(d, f))
                           for d, _, files in os.walk(directory) for f in files)
                if used + nbytes > limit:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

        posix_fallocate, store_set = os.posix_fallocate, zarr.storage.LocalStore.set

        def fallocate_on_the_disk(fd, offset, length):
            check(os.readlink(f"/proc/self/fd/{fd}"), offset + length)  # "dir/#123 (deleted)"
            posix_fallocate(fd, offset, length)

        async def set_on_the_disk(store, key, value):
            check(os.path.join(str(store.root), key), len(value))
            await store_set(store, key, value)

        monkeypatch.setattr(os, "posix_fallocate", fallocate_on_the_disk)
        monkeypatch.setattr(zarr.storage.LocalStore, "set", set_on_the_disk)
        return directory

    return make


def used_nbytes(directory) -> int:
    st = os.statvfs(directory)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def unlinked_files_nbytes(pid: int, directory) -> int:
    """Bytes allocated to the unlinked files under `directory` that process `pid` holds open."""
    sizes = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith(f"{directory}{os.sep}") and target.endswith(" (deleted)"):
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                sizes[st.st_ino] = st.st_blocks * 512
        except FileNotFoundError:  # closed meanwhile
            pass
    return sum(sizes.values())


@pytest.fixture
def sigkilled_child_frees(small_tmpfs, tmp_path):
    """check(code, size, nbytes): `code` (DIRECTORY in it names the directory) runs in a child
    that makes a swap file of at least `nbytes`, prints one line when it holds it, then sleeps
    until it is killed with SIGKILL (no handler, no atexit runs). Asserts the file took its
    space (the child's unlinked files there, seen through /proc), no name is left, and the
    space comes back.

    The directory is a private tmpfs of `size` where this process may mount: its used space
    returns to what it was. Else tmp_path's shared file system, which others write meanwhile:
    its used space drops by the file's size (16 MiB of slack) when the child dies. Space freed
    by the kernel after death may show up a moment later, so it is polled (up to 60 s).
    """
    def check(code: str, size: str, nbytes: int) -> None:
        directory = small_tmpfs(size)
        private = directory is not None
        directory = directory if private else tmp_path
        before = used_nbytes(directory)
        code = code.replace("DIRECTORY", repr(str(directory)))
        child = subprocess.Popen([sys.executable, "-c", code + "\nimport time\ntime.sleep(600)\n"],
                                 cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        try:
            line = child.stdout.readline()
            assert line, child.stderr.read()
            held = unlinked_files_nbytes(child.pid, directory)
            alive = used_nbytes(directory)
        finally:
            child.kill()
            child.wait(timeout=60)
            child.stdout.close()
            child.stderr.close()
        assert held >= nbytes, "the child's swap file took no space: test broken"
        assert sorted(os.listdir(directory)) == []

        def freed(after: int) -> bool:
            return after <= before if private else alive - after >= held - (16 << 20)

        deadline = time.monotonic() + 60
        while not freed(after := used_nbytes(directory)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert freed(after), f"{after - before} bytes still used after the child died"

    return check


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory):
    """A local Hugging Face directory as `save_pretrained` writes it: a tiny random Llama (fp32,
    untied head) and the byte-level tokenizer (256 bytes + <s>, </s>, <pad>), nothing downloaded."""
    import transformers  # a dependency: a broken install fails the tests that use it

    from infinity.models import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_VOCAB_SIZE, byte_tokenizer

    directory = tmp_path_factory.mktemp("tiny-llama")
    byte_tokenizer().save_pretrained(directory)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=BYTE_VOCAB_SIZE, hidden_size=32,
                                      intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=False,
                                      bos_token_id=BYTE_BOS_ID, eos_token_id=BYTE_EOS_ID)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory
