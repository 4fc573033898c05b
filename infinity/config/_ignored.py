"""DeepSpeed sections Infinity accepts, checks for typos and types, and does not act on.

Each has `SECTION_REASON`: why it is not honoured (logged once when the section is present).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from infinity.config._section import Section


@dataclass(kw_only=True, frozen=True)
class FlopsProfilerConfig(Section):
    """`flops_profiler`: DeepSpeed's FLOP counter."""

    enabled: bool = False
    """DeepSpeed: profile one step. Default false."""
    recompute_fwd_factor: float = 0.0
    """DeepSpeed: share of forward recomputed under activation checkpointing. Default 0."""
    profile_step: int = 1
    """DeepSpeed: the step to profile. Default 1."""
    module_depth: int = -1
    """DeepSpeed: depth of the module report. Default -1."""
    top_modules: int = 1
    """DeepSpeed: modules listed in the report. Default 1."""
    detailed: bool = True
    """DeepSpeed: print the detailed profile. Default true."""
    output_file: str | None = None
    """DeepSpeed: where the report goes. Default null (stdout)."""

    SECTION_REASON: ClassVar[str] = ("no FLOP counter; engine.stats() and engine.write_trace() "
                                     "report time, bytes and bandwidth per step")


_MONITOR = "Infinity has no metrics writer; engine.stats() returns the numbers to log yourself"


@dataclass(kw_only=True, frozen=True)
class MonitorConfig(Section):
    """`tensorboard` and `csv_monitor`: DeepSpeed's metric writers."""

    enabled: bool = False
    """DeepSpeed: write metrics. Default false."""
    output_path: str = ""
    """DeepSpeed: where to write them. Default "" (the launch directory)."""
    job_name: str = "DeepSpeedJobName"
    """DeepSpeed: sub-directory of this run. Default "DeepSpeedJobName"."""

    SECTION_REASON: ClassVar[str] = _MONITOR


@dataclass(kw_only=True, frozen=True)
class WandbConfig(Section):
    """`wandb`: DeepSpeed's Weights & Biases writer."""

    enabled: bool = False
    """DeepSpeed: log to WandB. Default false."""
    group: str | None = None
    """DeepSpeed: the WandB group. Default null."""
    team: str | None = None
    """DeepSpeed: the WandB team. Default null."""
    project: str = "deepspeed"
    """DeepSpeed: the WandB project. Default "deepspeed"."""

    SECTION_REASON: ClassVar[str] = _MONITOR
