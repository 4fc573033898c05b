"""`load_config`: a DeepSpeed JSON (dict or file) -> a validated, "auto"-free `Config`."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
from typing import Any

import torch

from infinity.config._auto import fill_auto, fill_batch
from infinity.config._config import Config
from infinity.config._legacy import hoist_nested_aio, translate_cpu_offload
from infinity.config._machine import total_memory_bytes
from infinity.config._parse import Notes, Tree, build, read
from infinity.config._paths import check_writable_dir
from infinity.config._sections import AioConfig, InfinityConfig
from infinity.config._values import FieldError
from infinity.errors import ConfigError, ConfigPathError

logger = logging.getLogger(__name__)


def read_json(config: dict[str, Any] | str | os.PathLike[str]) -> Any:
    """The config as given (a dict), or read from its JSON file; ConfigError /
    ConfigPathError naming the file."""
    if isinstance(config, dict):
        return config
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(f"config is a {type(config).__name__}: pass a dict or the path of a "
                          "DeepSpeed JSON file")
    path = os.fspath(config)
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path}: not valid JSON at line {exc.lineno} column "
                          f"{exc.colno}: {exc.msg}") from None
    except OSError as exc:
        raise ConfigPathError(exc.errno or errno.EIO, f"config file: cannot read it "
                              f"({exc.strerror})", path) from None


def load_config(config: Config | dict[str, Any] | str | os.PathLike[str], *,
                model: torch.nn.Module | None = None, world_size: int = 1) -> Config:
    """Parse and validate a DeepSpeed-style config; fill "auto" from `model` and the machine.

    Parameters
    ----------
    config:
        The JSON as a dict (not modified), or the path of a JSON file; a `Config` is returned
        as it is.
    model:
        Used for "auto" bucket sizes (`model.config.hidden_size`, as the Hugging Face
        integration reads it); without one those get DeepSpeed's defaults.
    world_size:
        Data-parallel ranks, for the batch-size rule.

    Raises
    ------
    ConfigError
        An unknown key (with the closest valid one), a value of the wrong type or out of range
        (naming the key, the value and what is allowed), or an impossible combination.
    ConfigPathError
        (an OSError and a ConfigError) the file cannot be read, or an `nvme_path` is not a
        writable directory and cannot be created.

    Logs at most two info lines: the values filled for "auto" or absent keys, and the keys
    accepted but not honoured (docs/engine.md says why for each).
    """
    if isinstance(config, Config):
        return config  # already loaded: initialize() may be handed one
    raw = read_json(config)
    notes = Notes()
    raw, nested_aio = hoist_nested_aio(translate_cpu_offload(raw, notes))
    tree = read(Config, raw, "", notes)
    if nested_aio is not None:
        tree.values["aio"] = read(AioConfig, nested_aio, "zero_optimization.aio", notes)
    tree.values.setdefault("infinity", Tree(InfinityConfig, {}))
    fill_batch(tree, world_size, notes)
    fill_auto(tree, model=model, notes=notes)
    result = build(tree, "", notes, world_size=world_size)
    _check_machine(result)
    result = dataclasses.replace(result, auto_filled=tuple(notes.filled),
                                 not_honoured=tuple(notes.not_honoured))
    if notes.filled:
        logger.info("config: filled %s", "; ".join(notes.filled))
    if notes.not_honoured:
        logger.info("config: accepted, not honoured: %s", "; ".join(notes.not_honoured))
    return result


def _check_machine(config: Config) -> None:
    """What depends on this machine: the memory budget fits, the NVMe directories are usable."""
    budget, total = config.infinity.host_memory_budget, total_memory_bytes()
    if budget is not None and budget > total:
        raise FieldError("infinity.host_memory_budget", budget,
                         f"at most this machine's memory, {total} bytes ({total / 2**30:.1f} "
                         "GiB)")
    zero = config.zero_optimization
    checked = set()
    for name, offload in (("offload_param", zero.offload_param),
                          ("offload_optimizer", zero.offload_optimizer)):
        if offload.device == "nvme" and offload.nvme_path not in checked:
            check_writable_dir(offload.nvme_path, f"zero_optimization.{name}.nvme_path")
            checked.add(offload.nvme_path)
