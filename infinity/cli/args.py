"""Argument parsing and timing shared by the command-line tools."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable

from infinity.config import parse_bytes


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults on every option; the module docstring (with its examples) kept as written."""


def log_to_stderr(verbose: bool) -> None:
    """The library's log lines on stderr: INFO and up with --verbose, else warnings only."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


def fail(prog: str, message: str) -> int:
    """One line on stderr for bad input; the exit code 2 (argparse's for usage errors)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def parse_size(text: str) -> int:
    """A byte count as the config writes it (`infinity.config.parse_bytes`: "2G" and "2GiB" are
    2 * 2**30, "2GB" is 2e9), for argparse; at least 1."""
    try:
        nbytes = parse_bytes(text)
    except ValueError:
        nbytes = 0
    if nbytes < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 4096, 256K, 1M, 2G "
                                         "(binary) or 2GB (decimal)")
    return nbytes


def time_in_turns(fns: dict[str, Callable[[], object]], rounds: int, warmup: int
                  ) -> dict[str, list[float]]:
    """Seconds per call of each fn in every timed round; one call of each per round, so a change
    in machine load hits every fn alike."""
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if i >= warmup:
                seconds[name].append(time.perf_counter() - start)
    return seconds
