"""Error types of the engine. Each names the culprit and, where there is one, the fix."""


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names the key and what would be right."""


class BudgetError(MemoryError):
    """A memory budget (arena, tier, pool) cannot hold what was asked; the message carries the stats."""


class ConfigPathError(OSError, ConfigError):
    """A path in the configuration cannot be used (missing, not a directory, not writable).

    An OSError (errno, strerror naming the config key, filename) and a ConfigError at once, so
    callers catching either see it.
    """


class CheckpointError(ValueError):
    """A checkpoint directory cannot be loaded as it is (a file missing, truncated or corrupt, a
    tensor absent, unknown or of the wrong shape); the message names the file and the tensor.

    Attributes: `path` (the file at fault) and `tensor` (the tensor's name, or None).
    """

    def __init__(self, message: str, *, path: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.tensor = tensor
