"""The package as a user installs it: the wheel built from this checkout, installed into a fresh
virtual environment outside it, imports every module and runs `infinity-train --steps 2`.

CI otherwise runs an editable install, whose finder serves any module of the checkout, so a
module, data file or native extension missing from the wheel went unseen (infinity.checkpointing
once was). Here nothing of the checkout is reachable: the venv sees the host's site-packages (for
torch and the other dependencies) only as plain path entries, so no `.pth` there runs (the
editable finder is installed by one), PYTHONPATH is dropped and the commands run elsewhere.
"""

import json
import os
import pathlib
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("aio", "infinity")  # the only top-level names the wheel may install
# Build outputs and caches a checkout may hold; the wheel must come from the sources alone.
NOT_SOURCES = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "*.so",
                                     "*.o", "_cffi_*.c", "_*_cffi.c", ".pytest_cache",
                                     ".ruff_cache")

# Imports every module, then runs the installed console script in the same process (the
# script as pip wrote it, run as __main__), then checks where each module of ours came from.
_CHECK = r"""
import importlib, json, pathlib, runpy, sys
venv = pathlib.Path(sys.prefix).resolve()
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
script = sys.argv[2]
sys.argv = [script, *sys.argv[3:]]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as exc:
    assert exc.code in (0, None), f"{script} exited {exc.code}"
ours = {n: getattr(m, "__file__", None) for n, m in sys.modules.items()
        if n.split(".")[0] in ("aio", "infinity")}  # cffi's `lib` objects have no file
outside = {n: f for n, f in ours.items()
           if f and not pathlib.Path(f).resolve().is_relative_to(venv)}
assert not outside, f"imported from outside the venv: {outside}"
print(json.dumps(sorted(ours)))
"""


def _modules(root: pathlib.Path) -> list[str]:
    """Every module of the packages under `root`, and the native extensions csrc/ builds."""
    names = []
    for top in PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    for build in sorted((root / "csrc").glob("build_*.py")):
        names += re.findall(r'set_source\(\s*"([\w.]+)"', build.read_text())
    return names


def _package_files(root: pathlib.Path) -> set[str]:
    """The source and data files of the packages under `root`, relative to `root`."""
    files = set()
    for top in PACKAGES:
        for path in (root / top).rglob("*"):
            rel = path.relative_to(root)
            if path.is_file() and not NOT_SOURCES(str(path.parent), [path.name]) \
                    and "__pycache__" not in rel.parts:
                files.add(str(rel))
    return files


def _run(args: list, *, cwd: pathlib.Path, env: dict[str, str], timeout: int) -> str:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    command = " ".join(str(a)[:60] for a in args)
    assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-3000:]}"
    return done.stdout


def test_the_wheel_installs_imports_and_trains_outside_the_checkout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["CFLAGS"] = f"{env.get('CFLAGS', '')} -g0"  # no debug info: the same code, a third less
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCES)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "--no-index", "-w", tmp_path / "dist", source], cwd=tmp_path, env=env, timeout=600)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        tops = {name.split("/")[0] for name in z.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == set(PACKAGES), tops

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path, env=env, timeout=120)
    purelib = pathlib.Path(sysconfig.get_path("purelib", vars={"base": venv, "platbase": venv}))
    host = [*site.getsitepackages(), site.getusersitepackages()]
    (purelib / "_host_site_packages.pth").write_text("\n".join(host) + "\n")
    python = venv / "bin" / "python"
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", "--no-index",
          wheel], cwd=tmp_path, env=env, timeout=300)
    missing = _package_files(source) - {str(p.relative_to(purelib)) for p in purelib.rglob("*")}
    assert not missing, f"installed without {sorted(missing)}"

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    wanted = _modules(source)
    out = _run([python, "-c", _CHECK, json.dumps(wanted), venv / "bin" / "infinity-train",
                "--steps", "2"], cwd=elsewhere, env=env, timeout=600)
    imported = json.loads(out.strip().splitlines()[-1])
    assert set(wanted) <= set(imported), set(wanted) - set(imported)
    assert re.search(r"steps\s+2 of 2", out), out
