"""Argument parsing shared by the command-line tools."""

from __future__ import annotations

import argparse

SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'2G' -> 2 * 2**30 bytes; K/M/G/T are binary (KiB...), an optional trailing 'B' or 'iB'."""
    body = text.strip().upper().removesuffix("IB").removesuffix("B")
    suffix = body[-1:] if body[-1:].isalpha() else ""
    number = body[:len(body) - len(suffix)]
    if suffix not in SUFFIXES or not number.isdigit() or int(number) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 4096, 256K, 1M or 2G")
    return int(number) * SUFFIXES[suffix]
