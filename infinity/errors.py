"""Error types of the engine. Each names the culprit and, where there is one, the fix."""


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names the key and what would be right."""


class BudgetError(MemoryError):
    """A memory budget (arena, tier, pool) cannot hold what was asked; the message has the stats."""


class WouldWait(BudgetError):
    """A fetch asked not to wait (`TensorStore.fetch(wait=False)`, a read ahead) found no room
    on its tier without waiting for I/O in flight or another thread's release: nothing was
    fetched; ask again later."""


class ConfigPathError(OSError, ConfigError):
    """A path in the configuration cannot be used (missing, not a directory, not writable).

    An OSError (errno, strerror naming the config key, filename) and a ConfigError at once, so
    callers catching either see it.
    """


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read as asked: not a checkpoint, a missing, truncated or
    corrupt file, an unknown format version, a tag that exists, a tensor absent, unknown or of the
    wrong shape. The message names the tensor and file.

    Attributes: `path` (the file at fault) and `tensor` (the tensor's name), where the raiser
    gives them (infinity.models.load always does), else None.
    """

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.tensor = tensor


class NonFiniteGradientError(ValueError):
    """A gradient of the step holds inf/nan (fp32/bf16; under fp16 an overflow skips the step
    instead). The message names the unit; the step changed nothing (units the optimizer
    stepped during backward were rolled back): `zero_grad()` and go on."""


class ClosedError(ValueError, RuntimeError):
    """An object was used after close() (the engine, the store, ...). A ValueError and a
    RuntimeError at once, what callers caught before it had a name of its own."""


class InputError(ValueError):
    """Training input that cannot be used (model directory, data, sequence length, output path);
    the message names it and what would work."""


class RankError(RuntimeError):
    """A collective across data-parallel ranks failed: a peer rank died, or the collective ran
    past `infinity.collective_timeout`. The message names this rank, the collective, and the
    ranks that did not answer where they could be found.

    Attributes: `rank` (this rank), `collective` (what was being done), `peers` (ranks found
    not answering; empty when unknown).
    """

    def __init__(self, message: str, *, rank: int, collective: str,
                 peers: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.rank = rank
        self.collective = collective
        self.peers = peers


def described(exc: BaseException) -> str:
    """`Type: first line of the message` (or `Type` alone): an error from a library that raises
    many kinds, short enough for the one line an InputError or a report gives it."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
