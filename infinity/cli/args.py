"""Argument parsing and timing shared by the command-line tools."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable

SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


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
    """'2G' -> 2 * 2**30 bytes; K/M/G/T are binary (KiB...), an optional trailing 'B' or 'iB'."""
    body = text.strip().upper().removesuffix("IB").removesuffix("B")
    suffix = body[-1:] if body[-1:].isalpha() else ""
    number = body[:len(body) - len(suffix)]
    if suffix not in SUFFIXES or not number.isdigit() or int(number) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 4096, 256K, 1M or 2G")
    return int(number) * SUFFIXES[suffix]


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
