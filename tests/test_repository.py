"""Repository-level contracts: layering of imports, README commands run by CI, lint."""

import ast
import pathlib
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Every package of the project, top layer first, with the packages it may import (besides
# itself and third-party modules). Arrows point down only (docs/design.md, "Layers", lists it).
# A key is a module path: "infinity.store" is infinity/store/ with everything under it,
# "infinity.config" is infinity/config.py (or an infinity/config/ package). "infinity.__init__"
# is the package's front door, infinity/__init__.py alone. An allowed name covers the packages
# under it ("infinity" = every infinity.* key). Every .py file under aio/, infinity/ and tools/
# must belong to a key, so a new package fails test_imports_point_down_the_layers until it gets
# its row here, below everything it imports and above everything that imports it.
LAYERS: dict[str, set[str]] = {
    "tools": {"infinity", "aio"},
    # the console scripts' faces over the library
    "infinity.cli": {"infinity.train", "infinity.models", "infinity.checkpoint", "infinity.memory",
                     "infinity.config", "infinity.errors", "aio"},  # config: its size parser
    # the Hugging Face Trainer and DeepSpeed's API over the engine (docs/hf.md)
    "infinity.hf": {"infinity.deepspeed", "infinity.models", "infinity.config", "infinity.errors"},
    "infinity.deepspeed": {"infinity.engine", "infinity.recompute", "infinity.checkpoint",
                           "infinity.zero", "infinity.config", "infinity.errors"},
    "infinity.train": {"infinity.engine", "infinity.models", "infinity.checkpoint", "infinity.zero",
                       "infinity.optim", "infinity.config", "infinity.store", "infinity.memory",
                       "infinity.errors", "aio"},
    "infinity.__init__": {"infinity.models", "infinity.engine", "infinity.recompute",
                          "infinity.config", "infinity.errors"},
    # models sits above the engine: a loaded model's store is laid out by the engine's own plan
    # (precision, units, budgets), so initialize adopts it without a copy.
    "infinity.models": {"infinity.engine", "infinity.zero", "infinity.config", "infinity.store",
                        "infinity.memory", "infinity.errors", "infinity.paths", "aio"},
    "infinity.engine": {"infinity.recompute", "infinity.config", "infinity.zero", "infinity.optim",
                        "infinity.checkpoint", "infinity.store", "infinity.memory",
                        "infinity.errors", "aio"},
    # recompute: activation recomputation (DeepSpeed's deepspeed.checkpointing), configured from
    # the config section; the engine configures it, the zero hooks see its recompute.
    "infinity.recompute": {"infinity.config", "infinity.errors"},
    "infinity.checkpoint": {"infinity.config", "infinity.store", "infinity.memory",
                            "infinity.errors", "infinity.paths", "aio"},
    # zero: optim's native sum of squares checks the gradients and takes the norm's terms
    "infinity.zero": {"infinity.config", "infinity.optim", "infinity.store", "infinity.memory",
                      "infinity.errors", "aio"},
    "infinity.config": {"infinity.errors", "aio"},  # aio: its options
    "infinity.optim": {"infinity.store", "infinity.memory", "infinity.errors", "aio"},
    "infinity.store": {"infinity.memory", "infinity.errors", "aio"},
    "infinity.memory": {"infinity.errors", "aio"},
    # paths: a path read from a file stays inside the folder the file was found in
    "infinity.paths": {"infinity.errors"},
    "infinity.errors": set(),
    "aio": set(),
}
SOURCE_DIRS = ("aio", "infinity", "tools")


def _covers(outer: str, name: str) -> bool:
    """`outer` is `name` or a package above it (dot boundary: "aio" does not cover "aiofiles")."""
    return name == outer or name.startswith(outer + ".")


def _owner(key: str, layers: dict[str, set[str]]) -> str | None:
    """The layer-table key a module key ("infinity.store.moves", "aio.__init__") belongs to."""
    owners = [k for k in layers if _covers(k, key)]
    return max(owners, key=len) if owners else None


def _module_key(path: pathlib.Path, root: pathlib.Path) -> str:
    """infinity/store/moves.py -> "infinity.store.moves";
    infinity/__init__.py -> "infinity.__init__"."""
    return ".".join(path.relative_to(root).with_suffix("").parts)


def _file_of(name: str, root: pathlib.Path) -> pathlib.Path | None:
    """The source file of module `name`, or of its longest prefix that has one (a native
    extension such as aio._aio_cffi counts as its package)."""
    parts = name.split(".")
    while parts:
        base = root.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        parts.pop()
    return None


def _is_module(name: str, root: pathlib.Path) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _resolve_relative(name: str, level: int, path: pathlib.Path, root: pathlib.Path) -> str:
    """`from ..x import y` in `path` -> the absolute module name of `..x`."""
    package = list(path.relative_to(root).parent.parts)
    if level - 1 > len(package):
        return name  # beyond the top: Python refuses it; leave it to the other checks
    package = package[: len(package) - (level - 1)]
    return ".".join(package + ([name] if name else []))


def _literal(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _dynamic_import(call: ast.Call) -> tuple[str, str | None] | None:
    """(name, package) of importlib.import_module("...") / import_module / __import__ with a
    literal name; None for any other call."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in ("import_module", "__import__"):
        return None
    keywords = {kw.arg: kw.value for kw in call.keywords}
    target = _literal(call.args[0] if call.args else keywords.get("name"))
    if target is None:
        return None
    package = call.args[1] if name == "import_module" and len(call.args) > 1 else None
    return target, _literal(keywords.get("package", package))


def _imports(path: pathlib.Path, root: pathlib.Path):
    """Absolute names of the modules `path` imports: plain, relative and importlib imports."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                module = _resolve_relative(module, node.level, path, root)
            for alias in node.names:  # `from pkg import sub` imports the module pkg.sub
                sub = f"{module}.{alias.name}" if module else alias.name
                yield sub if _is_module(sub, root) else module
        elif isinstance(node, ast.Call) and (found := _dynamic_import(node)):
            target, package = found
            level = len(target) - len(target.lstrip("."))
            if level:
                anchor = package or ".".join(path.relative_to(root).parent.parts)
                anchor_parts = anchor.split(".")
                stem = anchor_parts[: len(anchor_parts) - (level - 1)]
                target = ".".join(stem + ([target[level:]] if target[level:] else []))
            yield target


def _private_owner(name: str) -> str | None:
    """The package whose private module `name` is ("infinity.zero" for infinity.zero._common.x),
    or None when no part of `name` is private."""
    parts = name.split(".")
    private = next((i for i, p in enumerate(parts) if p.startswith("_") and not p.startswith("__")),
                   None)
    return None if private is None else ".".join(parts[:private])


def layering_violations(root: pathlib.Path, layers: dict[str, set[str]]) -> list[str]:
    """Every import in aio/, infinity/, tools/ under `root` that points up or sideways, or that
    reaches into another package's private module, and every file whose package is not in
    `layers`."""
    bad = []
    tops = {key.split(".")[0] for key in layers}
    for top in SOURCE_DIRS:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            owner = _owner(_module_key(path, root), layers)
            if owner is None:
                bad.append(f"{rel} belongs to no package of the layer table: add its package to "
                           f"LAYERS in tests/test_repository.py, placed below what it imports")
                continue
            for name in _imports(path, root):
                if name.split(".")[0] not in tops:
                    continue  # third party or standard library
                target_file = _file_of(name, root)
                target = _owner(_module_key(target_file, root), layers) if target_file else None
                if target is None:
                    bad.append(f"{rel} imports {name}, which is no module of the layer table")
                elif target != owner and not any(_covers(ok, target) for ok in layers[owner]):
                    bad.append(f"{rel} imports {name} ({owner} may import only "
                               f"{sorted(layers[owner]) or 'nothing of the project'})")
                elif (package := _private_owner(name)) and not _covers(
                        package, _module_key(path, root)):
                    bad.append(f"{rel} imports {name}, a private module of {package}: import "
                               f"the name from {package}, which exports it")
    return bad


def test_imports_point_down_the_layers():
    bad = layering_violations(ROOT, LAYERS)
    assert not bad, "imports against the layering (docs/design.md):\n" + "\n".join(bad)


def _design_layers() -> dict[str, set[str]]:
    """The layer table of docs/design.md ("may import" names x for infinity.x, except the
    top-level names; "-" for nothing), in its order."""
    text = (ROOT / "docs" / "design.md").read_text()
    rows = text.split("| package | may import", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    tops = {key.split(".")[0] for key in LAYERS}
    table = {}
    for row in rows:
        package, allowed = (cell.strip() for cell in row.strip("|").split("|")[:2])
        names = [] if allowed == "-" else [n.strip() for n in allowed.split(",")]
        table[package.strip("`")] = {n if n in tops else f"infinity.{n}" for n in names}
    return table


def test_design_doc_lists_the_layer_table():
    """docs/design.md shows LAYERS, row for row in the same order: change both together."""
    design = _design_layers()
    assert list(design) == list(LAYERS), "docs/design.md lists the packages in another order"
    differ = {k: (design[k], LAYERS[k]) for k in LAYERS if design[k] != LAYERS[k]}
    assert not differ, f"docs/design.md's layer table differs (doc, test): {differ}"


def test_layer_table_points_down_only():
    """Each package may import only packages listed below it, so the table has no cycle."""
    keys = list(LAYERS)
    for i, (key, allowed) in enumerate(LAYERS.items()):
        for ok in allowed:
            covered = [k for k in keys if _covers(ok, k)]
            assert covered, f"{key} may import {ok}, which is not in the table"
            above = [k for k in covered if keys.index(k) <= i]
            assert not above, f"{key} may import {ok}, but {above} is not below {key}"


def _tree(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


SYNTHETIC_LAYERS = {
    "tools": {"infinity", "aio"},
    "infinity.__init__": {"infinity.errors"},
    "infinity.storage": {"infinity.store", "infinity.errors"},
    "infinity.store": {"infinity.memory", "infinity.errors", "aio"},
    "infinity.memory": {"infinity.errors", "aio"},
    "infinity.errors": set(),
    "aio": set(),
}
SYNTHETIC_CLEAN = {
    "aio/__init__.py": "import aiofiles\nfrom aio import _native\n",
    "aio/_native.py": "import os\nfrom aio._aio_cffi import ffi\n",  # a native extension
    "infinity/__init__.py": "from infinity.errors import ConfigError\n",
    "infinity/errors.py": "",
    "infinity/memory/__init__.py": "from . import arena\n",
    "infinity/memory/arena.py": "from ..errors import BudgetError\nfrom ._backing import x\n",
    "infinity/memory/_backing.py": "from infinity.memory import _move\n",
    "infinity/memory/_move.py": "",
    "infinity/store/__init__.py": "from infinity import errors\n"
                                  "from infinity.memory import arena\n",
    "infinity/storage/__init__.py": "import importlib\nimportlib.import_module('infinity.store')\n",
    "tools/__init__.py": "import infinity.store\nimport aio\n",
}


@pytest.mark.parametrize("rel, text, complaint", [
    ("infinity/memory/up.py", "import infinity.store\n", "imports infinity.store"),
    ("infinity/memory/up.py", "from ..store import x\n", "imports infinity.store"),
    ("infinity/memory/up.py", "from .. import store\n", "imports infinity.store"),
    ("infinity/memory/up.py", "import importlib\nimportlib.import_module('infinity.store')\n",
     "imports infinity.store"),
    ("infinity/memory/up.py", "from importlib import import_module\n"
     "import_module('..store', package='infinity.memory')\n", "imports infinity.store"),
    ("infinity/memory/up.py", "__import__('tools')\n", "imports tools"),
    ("infinity/memory/up.py", "import importlib\nimportlib.import_module(name='infinity.store')\n",
     "imports infinity.store"),
    ("infinity/store/up.py", "import infinity.storage\n", "imports infinity.storage"),
    ("aio/up.py", "from infinity.errors import ConfigError\n", "imports infinity.errors"),
    ("infinity/errors.py", "from infinity import ConfigError\n", "imports infinity ("),
    ("infinity/zero/__init__.py", "", "infinity/zero/__init__.py belongs to no package"),
    ("infinity/engine.py", "", "infinity/engine.py belongs to no package"),
    ("infinity/memory/up.py", "import infinity.nowhere\n", "imports infinity.nowhere"),
    ("infinity/store/up.py", "from infinity.memory._backing import x\n",
     "private module of infinity.memory"),
    ("infinity/store/up.py", "from ..memory import _move\n", "private module of infinity.memory"),
    ("infinity/store/up.py", "import aio._native\n", "private module of aio"),
], ids=["upward", "relative-upward", "relative-from-package", "importlib", "import_module-relative",
        "dunder-import", "import_module-keyword", "prefix-without-dot", "aio-knows-no-infinity",
        "front-door",
        "unlisted-package", "unlisted-module", "missing-module", "private-module",
        "private-module-relative", "private-module-of-aio"])
def test_layering_checker_catches(tmp_path, rel, text, complaint):
    root = _tree(tmp_path, SYNTHETIC_CLEAN)
    assert layering_violations(root, SYNTHETIC_LAYERS) == []
    _tree(root, {rel: text})
    bad = layering_violations(root, SYNTHETIC_LAYERS)
    assert len(bad) == 1 and complaint in bad[0], bad


def _shell_commands(script: str) -> list[list[str]]:
    """The commands a bash script runs, as token lists: comments dropped, continuation lines
    joined, `;`, `&&` and `|` separated; `||` kept as a token (it hides a failure)."""
    commands: list[list[str]] = []
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split = True
        current: list[str] = []
        for token in lexer:
            if token in (";", "&&", "|", "&"):
                commands.append(current)
                current = []
            else:
                current.append(token)
        commands.append(current)
    return [c for c in commands if c]


def _readme_lines() -> list[str]:
    """The command lines of the README's first bash block (a line may chain commands with &&)."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def _ci_runs_in_order(ci: str, wanted: list[list[str]]) -> str | None:
    """None if `ci` runs errexit and then each of `wanted` as a command, in order; else why not."""
    commands = _shell_commands(ci)
    errexit = next((i for i, c in enumerate(commands)
                    if c[0] == "set" and ("errexit" in c or any(
                        o.startswith("-") and not o.startswith("--") and "e" in o
                        for o in c[1:]))), None)
    if errexit is None:
        return ".ci/run does not `set -e`, so a failing command would not fail CI"
    at = errexit
    for command in wanted:
        found = next((i for i in range(at + 1, len(commands)) if commands[i] == command), None)
        if found is None:
            return (f".ci/run does not run the README command {shlex.join(command)!r} "
                    "after `set -e` (in order)")
        at = found
    return None


def test_ci_runs_the_readme_commands():
    lines = _readme_lines()
    assert len(lines) == 2, ("the README must start with exactly two command lines: "
                             "setup (and the default run), test")
    problem = _ci_runs_in_order((ROOT / ".ci" / "run").read_text(),
                                _shell_commands("\n".join(lines)))
    assert problem is None, problem


@pytest.mark.parametrize("ci, complaint", [
    ("set -euo pipefail\n# pip install x\npython -m pytest -q\n", "pip install x"),
    ("set -e\npython -m pytest -q\npip install x\n", "python -m pytest -q"),
    ("set -e\necho pip install x\npip install x || true\npython -m pytest -q\n", "pip install x"),
    ("pip install x\npython -m pytest -q\n", "set -e"),
    ("set -e\npip install x  # setup\ncd . && python -m pytest -q\n", None),
])
def test_ci_check_needs_real_commands_in_order(ci, complaint):
    problem = _ci_runs_in_order(ci, [["pip", "install", "x"], ["python", "-m", "pytest", "-q"]])
    assert problem is None if complaint is None else complaint in problem


def test_lint_is_clean():
    """ruff (pyproject's rules: unused imports and variables, commented-out code, ...); ruff is
    in the [dev] extra, so its absence is a failed setup, not a reason to skip."""
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise",
                          str(ROOT)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
