"""Repository-level contracts: layering of imports, and README commands matching CI."""

import ast
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# A package may import only from the layers listed after it.
LAYERS = ["tools", "infinity.train", "infinity.engine", "infinity.zero", "infinity.optim", "infinity.checkpoint",
          "infinity.store", "infinity.memory", "aio"]
ALLOWED = {
    "tools": {"infinity", "aio"},
    "infinity.train": {"infinity.engine", "infinity.zero", "infinity.optim", "infinity.config", "infinity.store", "infinity.memory", "infinity.errors", "aio"},
    "infinity.engine": {"infinity.zero", "infinity.optim", "infinity.config", "infinity.store", "infinity.memory", "infinity.errors", "aio"},
    "infinity.zero": {"infinity.store", "infinity.memory", "infinity.errors", "aio"},
    "infinity.config": {"infinity.optim", "infinity.errors", "aio"},
    "infinity.optim": {"infinity.store", "infinity.memory", "infinity.errors", "aio"},
    "infinity.store": {"infinity.memory", "infinity.errors", "aio"},
    "infinity.memory": {"infinity.errors", "aio"},
    "aio": set(),
}


def _package_of(path: pathlib.Path) -> str | None:
    parts = path.relative_to(ROOT).with_suffix("").parts
    for depth in (2, 1):
        name = ".".join(parts[:depth])
        if name in ALLOWED:
            return name
    return None


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_imports_point_down_the_layers():
    project = ("aio", "infinity", "tools")
    bad = []
    for path in sorted(ROOT.glob("**/*.py")):
        if any(part in ("tests", "build", "csrc") or part.startswith(".") for part in path.relative_to(ROOT).parts):
            continue
        owner = _package_of(path)
        if owner is None:
            continue
        for name in _imports(path):
            if not name.startswith(project) or name.startswith(owner):
                continue
            if not any(name == ok or name.startswith(ok + ".") for ok in ALLOWED[owner]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "imports against the layering (DESIGN.md):\n" + "\n".join(bad)


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.strip() for line in block.strip().splitlines()]
    assert len(commands) == 2, "the README must start with exactly two commands: setup, test"
    ci = (ROOT / ".ci" / "run").read_text()
    for command in commands:
        assert command in ci, f".ci/run does not run the README command {command!r}"


def test_lint_is_clean():
    """ruff (pyproject's rules: unused imports and variables, commented-out code, ...)."""
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it is in the [dev] extra)")
    out = subprocess.run([ruff, "check", "--output-format", "concise", str(ROOT)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
