"""Where a run writes: --output (staged, locked), and the scratch directory of the NVMe files.

[Note: nothing half-written] Everything goes to a hidden sibling `.<output>.partial-<pid>`,
renamed to --output when the job ends well or when it saves its first checkpoint (which must
outlive a crash to be resumed: from then on the job writes in --output itself); any failure
before that removes it. All input is checked before, so bad input never leaves anything in
--output. A --resume works in --output itself. The export is written aside too (see
`export_aside`). Parameter and optimizer files go to a fresh temporary directory
`infinity-train-<pid>-*` (under --nvme-path when given), removed at the end whatever happens.

[Note: one run per output] A run holds an exclusive lock (flock) on `.<output>.lock`, a sibling
of --output holding its PID, from its start to its end; a second run on the same --output is
refused naming that PID. The kernel drops the lock when its holder dies however it dies, so
the lock of a dead run is simply taken over. Holding it, a run removes the staging
directories of earlier runs (`.<output>.partial-*`: none of them can be alive) and the scratch
directories whose owner is dead (each holds a flock on its `.lock` while it lives).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterator

from infinity.errors import InputError
from infinity.train import checkpoints

logger = logging.getLogger(__name__)

SCRATCH_PREFIX = "infinity-train-"
LOCK_NAME = ".lock"


class FileLock:
    """An exclusive flock on `path` (made if needed) holding this process's PID; `held_by`
    says who holds it when `acquire` fails."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> bool:
        """Take the lock (True), or False when a live process holds it."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:  # not a file its last holder unlinked as we opened it
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True

    def held_by(self) -> str:
        try:
            return self.path.read_text().strip() or "unknown"
        except OSError:
            return "unknown"

    def release(self, *, remove: bool = True) -> None:
        if self._fd is None:
            return
        if remove:
            with contextlib.suppress(OSError):
                self.path.unlink()
        os.close(self._fd)
        self._fd = None


def _is_free(lock_file: pathlib.Path) -> bool:
    """True when no live process holds a flock on `lock_file` (probed without keeping it)."""
    try:
        fd = os.open(lock_file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def remove_stale_scratch(base: str | None) -> None:
    """Remove `infinity-train-*` scratch directories under `base` (default: the system
    temporary directory) whose run is dead: their `.lock` is held by nobody."""
    base_dir = pathlib.Path(base or tempfile.gettempdir())
    with contextlib.suppress(OSError):
        for path in base_dir.glob(f"{SCRATCH_PREFIX}*"):
            if path.is_dir() and _is_free(path / LOCK_NAME):
                logger.warning("removing %s, left by a run that died", path)
                shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def scratch_dir(nvme_path: str | None) -> Iterator[Callable[[], str]]:
    """A lazily made temporary directory (under nvme_path when given), locked while it lives
    and removed at the end; scratch directories of dead runs beside it go first."""
    made: list[str] = []
    locks: list[FileLock] = []

    def get() -> str:
        if not made:
            try:
                if nvme_path is not None:
                    os.makedirs(nvme_path, exist_ok=True)
                remove_stale_scratch(nvme_path)
                path = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=nvme_path)
                made.append(path)
                lock = FileLock(pathlib.Path(path) / LOCK_NAME)
                lock.acquire()
                locks.append(lock)
            except OSError as e:
                where = f"--nvme-path {nvme_path}" if nvme_path else \
                    f"temporary directory {tempfile.gettempdir()}"
                raise InputError(f"{where}: cannot write there ({e.strerror})") from None
        return made[0]
    try:
        yield get
    finally:
        for lock in locks:
            lock.release(remove=False)
        if made:
            shutil.rmtree(made[0], ignore_errors=True)


class Output:
    """Where the job's files go now: the staging directory until `publish()`, then --output."""

    def __init__(self, final: pathlib.Path, staging: pathlib.Path | None) -> None:
        self.final, self.staging = final, staging

    @property
    def path(self) -> pathlib.Path:
        return self.staging or self.final

    def publish(self) -> None:
        """Make the staging directory --output (files open in it stay valid)."""
        if self.staging is None:
            return
        if self.final.exists():
            self.final.rmdir()
        self.staging.rename(self.final)
        self.staging = None


def _partials(final: pathlib.Path) -> list[pathlib.Path]:
    return [p for p in final.parent.glob(f".{final.name}.partial-*") if p.is_dir()]


@contextlib.contextmanager
def locked_output(output: str | None) -> Iterator[None]:
    """Hold [Note: one run per output] for the block; InputError when another run holds it.
    Staging directories of earlier runs on this --output are removed."""
    if output is None:
        yield
        return
    final = pathlib.Path(output)
    lock = FileLock(final.parent / f".{final.name}.lock")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        taken = lock.acquire()
    except OSError as e:
        raise InputError(f"--output {final}: cannot write there ({e.strerror})") from None
    if not taken:
        raise InputError(f"--output {final}: in use by another infinity-train run (PID "
                         f"{lock.held_by()}); wait for it or choose another --output")
    try:
        for stale in _partials(final):
            logger.warning("removing %s, left by a run that died", stale)
            shutil.rmtree(stale, ignore_errors=True)
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def staged_output(output: str | None, *, resume: bool = False) -> Iterator[Output | None]:
    """See [Note: nothing half-written]."""
    if output is None:
        yield None
        return
    final = pathlib.Path(output)
    if resume:
        yield Output(final, None)
        return
    if final.exists() and not (final.is_dir() and not any(final.iterdir())):
        hint = " (it holds checkpoints: add --resume to continue)" \
            if checkpoints.has_any(final) else ""
        raise InputError(f"--output {final}: exists and is not an empty directory{hint}")
    staging = final.parent / f".{final.name}.partial-{os.getpid()}"
    try:
        staging.mkdir(parents=True)
    except OSError as e:
        raise InputError(f"--output {final}: cannot write there ({e.strerror})") from None
    out = Output(final, staging)
    try:
        yield out
        out.publish()
    finally:
        if out.staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def check_nvme_path(nvme_path: str | None, output: str | None) -> None:
    """Refuse an --nvme-path equal to --output or inside it: the swap files would be moved
    with the run, or the finished model deleted with them."""
    if nvme_path is None or output is None:
        return
    swap, out = pathlib.Path(nvme_path).resolve(), pathlib.Path(output).resolve()
    if swap == out or out in swap.parents:
        raise InputError(f"--nvme-path {nvme_path}: inside --output {output}; put the NVMe "
                         "files elsewhere (they are temporary, the output is kept)")


@contextlib.contextmanager
def export_aside(directory: pathlib.Path, last: str) -> Iterator[pathlib.Path]:
    """A fresh `.export.partial` in `directory` to write an export into; when the block ends
    well its files are moved into `directory`, `last` (the file that makes the export whole,
    e.g. the index) after all the others, so a run killed meanwhile never leaves a model that
    looks complete. On failure the partial export is removed."""
    aside = directory / ".export.partial"
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir(parents=True)
    try:
        yield aside
        names = sorted(p.name for p in aside.iterdir())
        for name in [n for n in names if n != last] + [n for n in names if n == last]:
            if (directory / name).is_dir():  # an earlier export's (a resumed run exports again)
                shutil.rmtree(directory / name)
            os.replace(aside / name, directory / name)
    finally:
        shutil.rmtree(aside, ignore_errors=True)
