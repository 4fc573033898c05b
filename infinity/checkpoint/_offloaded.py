"""The optimizer state of a DeepSpeed ZeRO-3 checkpoint saved with NVMe optimizer offload.

Such a checkpoint keeps empty placeholders in `fp32_flat_groups` and copies DeepSpeed's swap
files into `offloaded_tensors/rank<RR>/`: per fp32 sub-group one raw fp32 file named after the
ds_ids of its first and last parameter, `<first>_<last>.tensor.swp`, and `exp_avg-<first>_<last>`
/ `exp_avg_sq-...` for the Adam moments, each padded at the end to DeepSpeed's I/O alignment.
Sub-groups are cut in parameter order and ds_ids grow in that order, so sorting the files by
their first id gives the sub-group order; each file must hold at least its sub-group's elements.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from infinity.errors import CheckpointError
from infinity.paths import inside

OFFLOAD_DIR = "offloaded_tensors"


def rank_dir(tag_dir: Path, rank: int) -> Path:
    return tag_dir / OFFLOAD_DIR / f"rank{rank:02d}"


def offloaded_groups(directory: Path, numels: list[int], state: str | None) -> list[torch.Tensor]:
    """One rank's sub-group tensors of `state` (None: the fp32 master weights), memory-mapped
    from the swap files in `directory`; CheckpointError naming the directory or file when files
    are missing or short."""
    prefix = "" if state is None else f"{state}-"
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)_(\d+)\.tensor\.swp$")
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is missing: the fp32 groups of this NVMe-offloaded "
                              f"checkpoint are empty placeholders and their data is not there")
    files = sorted((int(m.group(1)), path) for path in directory.iterdir()
                   if (m := pattern.match(path.name)))
    if len(files) != len(numels):
        raise CheckpointError(f"{directory} holds {len(files)} '{prefix}<first>_<last>.tensor.swp' "
                              f"files; the checkpoint has {len(numels)} sub-groups")
    groups = []
    tag_dir = directory.parents[1]
    for (_, path), numel in zip(files, numels):
        inside(tag_dir, str(path.relative_to(tag_dir)), source=directory)
        nbytes = path.stat().st_size
        if nbytes < numel * 4:
            raise CheckpointError(f"{path} holds {nbytes} bytes, its sub-group needs {numel * 4} "
                                  f"(truncated?)")
        groups.append(torch.from_file(str(path), shared=False, size=numel, dtype=torch.float32)
                      if numel else torch.empty(0))
    return groups
