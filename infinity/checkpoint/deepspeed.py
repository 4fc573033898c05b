"""Reading DeepSpeed ZeRO checkpoints (stages 1, 2, 3; any number of ranks; fp16/bf16/fp32 runs)
without DeepSpeed, a process group or a GPU, tensor by tensor.

Layouts (../shared/reference/deepspeed.md sections 6 and 11, checked against DeepSpeed's source):
- stage 3: per rank `zero_pp_rank_<r>_mp_rank_00_model_states.pt` (param_shapes, buffers, frozen
  fragments) and `[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt` whose `fp32_flat_groups`
  concatenated are that rank's partition: each parameter in `param_shapes` order takes
  ceil(numel / N) elements on every rank, rank r holding elements [r*p, (r+1)*p) of it and the
  last rank the padding.
- stages 1 and 2: one `mp_rank_00_model_states.pt`, and per rank an optim file whose
  `single_partition_of_fp32_groups[g]` is rank r's contiguous share of param group g's flat
  vector (parameters back to back; padding to 2*N elements at the end, dropped on the last rank).
Adam moments (`exp_avg`, `exp_avg_sq`) share the master weights' layout and are offered as
"exp_avg/<name>" when present (naming.py). Files are memory-mapped: a tensor's bytes are read
when it is read.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from infinity.checkpoint._common import ProgressCallback
from infinity.checkpoint._offloaded import OFFLOAD_DIR, offloaded_groups, rank_dir
from infinity.checkpoint._torch_file import load_pt
from infinity.checkpoint.naming import ADAM_STATES, is_model_weight, optimizer_state_name
from infinity.errors import CheckpointError
from infinity.paths import inside

logger = logging.getLogger(__name__)

_MODEL_STAGE3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_MODEL_STAGE12 = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def _has_model_states(directory: Path) -> bool:
    return directory.is_dir() and any(
        _MODEL_STAGE3.match(p.name) or _MODEL_STAGE12.match(p.name) for p in directory.iterdir())


def find_deepspeed_tag(directory: str | Path, tag: str | None = None) -> Path:
    """The tag directory of a DeepSpeed checkpoint: `directory/tag`, `directory` itself when it
    holds model states, else the tag its `latest` file names (inside `directory`)."""
    directory = Path(directory)
    if tag is None and _has_model_states(directory):
        return directory
    if tag is None:
        latest = directory / "latest"
        try:
            inside(directory, "latest", source=directory)
            tag = latest.read_bytes().decode().strip()
        except FileNotFoundError:
            raise CheckpointError(f"{directory} is not a DeepSpeed checkpoint: no 'latest' file and "
                                  f"no *_model_states.pt") from None
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{latest} cannot be read as a tag: {e}") from None
        path = inside(directory, tag, source=latest)
    else:
        path = inside(directory, tag, source=f"tag {tag!r}")
    if not _has_model_states(path):
        raise CheckpointError(f"{path} is not a DeepSpeed checkpoint tag: no *_model_states.pt in it")
    return path


def is_deepspeed_checkpoint(directory: str | Path) -> bool:
    try:
        find_deepspeed_tag(directory)
    except CheckpointError:
        return False
    return True


def _damaged(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what}: damaged, or not a DeepSpeed checkpoint file")


def _dict(container: dict, key: str, path: Path, *, optional: bool = False) -> dict:
    """container[key] as a dict ({} for a missing or None value when `optional`)."""
    value = container.get(key)
    if value is None and optional:
        return {}
    if not isinstance(value, dict):
        raise _damaged(path, f"{key!r} is {type(value).__name__}, not a dict")
    return value


def _tensors(value: Any, path: Path, what: str) -> list[torch.Tensor]:
    """`value` as a list of floating-point tensors."""
    if not isinstance(value, list | tuple) or not all(
            isinstance(t, torch.Tensor) and t.is_floating_point() for t in value):
        raise _damaged(path, f"{what} is not a list of floating-point tensors")
    return list(value)


def _name(name: Any, path: Path) -> str:
    if not isinstance(name, str) or not name or not is_model_weight(name) or "\0" in name:
        raise _damaged(path, f"{name!r} is not a parameter name")
    return name


def _shapes(value: Any, path: Path, what: str) -> dict[str, torch.Size]:
    """A {name: shape} mapping, checked: names of parameters, shapes of non-negative ints."""
    if not isinstance(value, dict):
        raise _damaged(path, f"{what} is {type(value).__name__}, not a dict of shapes")
    shapes = {}
    for name, shape in value.items():
        if not isinstance(shape, list | tuple) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise _damaged(path, f"{what}: the shape of {name!r} is {shape!r}")
        shapes[_name(name, path)] = torch.Size(shape)
    return shapes


def _group_shapes(model: dict, path: Path) -> list[dict[str, torch.Size]]:
    groups = model.get("param_shapes")
    if not isinstance(groups, list | tuple):
        raise _damaged(path, f"'param_shapes' is {type(groups).__name__}, not a list")
    return [_shapes(g, path, "'param_shapes'") for g in groups]


def _partition_count(zero: dict, path: Path) -> int:
    """The number of ranks; stage 1/2 give one per param group, all the same."""
    count = zero.get("partition_count")
    counts = list(count) if isinstance(count, list | tuple) else [count]
    if not counts or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0
                             for c in counts):
        raise _damaged(path, f"'partition_count' is {count!r}")
    return max(counts)


class _Flat:
    """Several 1-D tensors seen as one vector, sliced without copying."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts = [p.reshape(-1) for p in parts]
        self.starts = [0]
        for part in self.parts:
            self.starts.append(self.starts[-1] + part.numel())

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def pieces(self, start: int, length: int) -> Iterator[torch.Tensor]:
        """Views covering elements [start, start + length), in order."""
        index = bisect.bisect_right(self.starts, start) - 1
        while length > 0:
            local = start - self.starts[index]
            take = min(length, self.parts[index].numel() - local)
            yield self.parts[index][local:local + take]
            start, length, index = start + take, length - take, index + 1


class _Tensor:
    """Shape, dtype and where the elements come from (a function yielding flat pieces)."""

    __slots__ = ("shape", "dtype", "pieces")

    def __init__(self, shape: torch.Size, dtype: torch.dtype,
                 pieces: Callable[[], Iterator[torch.Tensor]]) -> None:
        self.shape, self.dtype, self.pieces = torch.Size(shape), dtype, pieces


def _whole(tensor: torch.Tensor) -> _Tensor:
    return _Tensor(tensor.shape, tensor.dtype, lambda: iter([tensor.reshape(-1)]))


def _span(flat: _Flat, segments: list[tuple[int, int]], shape: torch.Size, dtype: torch.dtype) -> _Tensor:
    return _Tensor(shape, dtype, lambda: (p for s, n in segments for p in flat.pieces(s, n)))


class DeepSpeedReader:
    """A DeepSpeed checkpoint (the run directory with `latest`, or a tag directory) as named
    tensors: model weights in full precision (the fp32 masters of trainable parameters, buffers
    and frozen parameters as saved, tied aliases) and Adam moments as "exp_avg/<name>".

    Raises CheckpointError naming the file for a missing rank file, a truncated, damaged or
    foreign file (every field used is checked for its type and size before anything is read),
    tensor-parallel or stage 1/2 NVMe-offloaded checkpoints (not supported), or shapes that do
    not add up to the flat groups. ZeRO-3 checkpoints of NVMe-offloaded optimizers are read
    from their `offloaded_tensors/` swap files (_offloaded.py).
    """

    def __init__(self, directory: str | Path, tag: str | None = None) -> None:
        self.path = find_deepspeed_tag(directory, tag)
        optim_files = self._rank_files()
        zero = self._zero_state(self._load(optim_files[0]), optim_files[0])
        world_size = _partition_count(zero, optim_files[0])
        if world_size != len(optim_files):
            missing = [f for f in self._expected_optim_names(world_size) if not (self.path / f).is_file()]
            raise CheckpointError(f"{self.path}: partition_count is {world_size} but "
                                  f"{len(optim_files)} optimizer files are there; missing: {missing}")
        zeros = [zero] + [self._zero_state(self._load(f), f) for f in optim_files[1:]]
        self.zero_stage = zero["zero_stage"]
        self.world_size = world_size
        self._files = optim_files
        self._tensors: dict[str, _Tensor] = {}
        if self.zero_stage == 3:
            model_files = [self.path / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world_size)]
        else:
            model_files = [self.path / "mp_rank_00_model_states.pt"]
        models = [self._model_state(self._load(f), f) for f in model_files]
        if self.zero_stage == 3:
            self._read_stage3(models, zeros, model_files[0])
        else:
            self._read_stage12(models[0], zeros, model_files[0])
        self._add_model_entries(models, model_files)
        self.metadata = self._metadata(models[0], zeros[0])
        logger.info("DeepSpeed checkpoint %s: ZeRO stage %d, %d ranks, %d tensors",
                    self.path, self.zero_stage, world_size, len(self._tensors))

    # -- the public face, shared with CheckpointReader --
    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensor(name).shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._tensor(name).dtype

    def iter_chunks(self, name: str, on_progress: ProgressCallback | None = None) -> Iterator[torch.Tensor]:
        """Tensor `name`'s elements as flat pieces in order (one per rank share or less)."""
        for piece in self._tensor(name).pieces():
            if on_progress is not None:
                on_progress(piece.numel() * piece.element_size())
            yield piece

    def read(self, name: str) -> torch.Tensor:
        tensor = self._tensor(name)
        pieces = list(self.iter_chunks(name))
        flat = torch.cat(pieces) if pieces else torch.empty(0, dtype=tensor.dtype)
        return flat.reshape(tensor.shape).clone()

    def _tensor(self, name: str) -> _Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(f"DeepSpeed checkpoint {self.path} holds no tensor {name!r}") from None

    # -- finding and checking the files --
    def _rank_files(self) -> list[Path]:
        found: dict[int, Path] = {}
        prefixes = set()
        for path in self.path.iterdir():
            match = _OPTIM.match(path.name)
            if not match:
                continue
            if int(match.group(3)) != 0:
                raise CheckpointError(f"{path}: tensor-parallel (mp_rank > 0) checkpoints are not "
                                      f"supported; merge the model-parallel ranks first")
            prefixes.add(match.group(1) or "")
            found[int(match.group(2))] = path
        if not found:
            raise CheckpointError(f"{self.path} holds no *_optim_states.pt: not a ZeRO checkpoint "
                                  f"(or saved without the optimizer)")
        if len(prefixes) > 1:
            raise CheckpointError(f"{self.path} mixes bf16_ and plain optimizer files: two saves "
                                  f"wrote into one tag")
        self._prefix = prefixes.pop()
        ranks = sorted(found)
        if ranks != list(range(len(ranks))):
            missing = sorted(set(range(ranks[-1] + 1)) - set(ranks))
            raise CheckpointError(f"{self.path}: missing rank file(s) "
                                  f"{[self._expected_optim_names(ranks[-1] + 1)[r] for r in missing]}")
        return [found[r] for r in ranks]

    def _load(self, path: Path) -> Any:
        """A .pt file of the tag, which must lie inside it (a symlink out is refused)."""
        return load_pt(inside(self.path, path.name, source=self.path))

    def _expected_optim_names(self, world_size: int) -> list[str]:
        return [f"{self._prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world_size)]

    @staticmethod
    def _zero_state(state: Any, path: Path) -> dict[str, Any]:
        """The ZeRO dict of an optimizer file, its stage checked (an int of 1..3)."""
        zero = state.get("optimizer_state_dict") if isinstance(state, dict) else None
        if not isinstance(zero, dict) or "zero_stage" not in zero:
            raise CheckpointError(f"{path} is not a ZeRO optimizer checkpoint (no zero_stage)")
        stage = zero["zero_stage"]
        if not isinstance(stage, int) or stage not in (1, 2, 3):
            raise CheckpointError(f"{path}: unknown ZeRO stage {stage!r}")
        return zero

    @staticmethod
    def _model_state(state: Any, path: Path) -> dict[str, Any]:
        if not isinstance(state, dict) or "param_shapes" not in state:
            raise _damaged(path, "no 'param_shapes' (a model states file holds them)")
        return state

    def _check_not_offloaded(self, groups: list[torch.Tensor]) -> None:
        if sum(g.numel() for g in groups) == 0 and (self.path / OFFLOAD_DIR).is_dir():
            raise CheckpointError(f"{self.path}: the fp32 groups are empty and the data is in "
                                  f"{OFFLOAD_DIR}/ (NVMe optimizer offload), which this reader "
                                  f"reads only for ZeRO-3 checkpoints")

    def _stage3_groups(self, zeros: list[dict], group_shapes: list[dict]) -> dict[str, list[list[torch.Tensor]]]:
        """Per kind ("weight", "exp_avg", "exp_avg_sq" when present), per rank, the sub-group
        tensors: from the optimizer files, or from the swap files of an NVMe-offloaded run."""
        numels = [sum(math.ceil(math.prod(s) / self.world_size) for s in g.values()) for g in group_shapes]
        stored = [_tensors(z.get("fp32_flat_groups"), f, "'fp32_flat_groups'")
                  for z, f in zip(zeros, self._files)]
        if sum(numels) and not any(t.numel() for groups in stored for t in groups):
            dirs = [rank_dir(self.path, r) for r in range(self.world_size)]
            found = {"weight": [offloaded_groups(d, numels, None) for d in dirs]}
            for state in ADAM_STATES:
                if any(p.name.startswith(f"{state}-") for p in dirs[0].iterdir()):
                    found[state] = [offloaded_groups(d, numels, state) for d in dirs]
            logger.info("%s: NVMe-offloaded optimizer state read from %s/", self.path, OFFLOAD_DIR)
            return found
        found = {"weight": stored}
        for state in ADAM_STATES:
            parts = [self._moments(z, state) for z in zeros]
            if all(p is not None for p in parts):
                found[state] = parts
        return found

    # -- the layouts --
    def _read_stage3(self, models: list[dict], zeros: list[dict], model_file: Path) -> None:
        group_shapes = _group_shapes(models[0], model_file)
        shapes = {k: v for group in group_shapes for k, v in group.items()}
        families = {kind: [_Flat(groups) for groups in ranks]
                    for kind, ranks in self._stage3_groups(zeros, group_shapes).items()}
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            share = math.ceil(numel / self.world_size)
            for kind, flats in families.items():
                key = name if kind == "weight" else optimizer_state_name(kind, name)
                self._tensors[key] = self._gathered(flats, offset, share, numel, shape)
            offset += share
        for kind, flats in families.items():
            for rank, flat in enumerate(flats):
                if flat.numel != offset:
                    raise CheckpointError(
                        f"{self.path}: param_shapes take {offset} elements per rank but the fp32 "
                        f"groups hold {flat.numel} ({kind}, rank {rank}): files from different "
                        f"runs?")

    def _gathered(self, flats: list[_Flat], offset: int, share: int, numel: int, shape: torch.Size) -> _Tensor:
        """Stage 3: `share` elements at `offset` of every rank, rank order, padding cut off."""
        def pieces() -> Iterator[torch.Tensor]:
            left = numel
            for flat in flats:
                take = min(share, left)
                yield from flat.pieces(offset, take)
                left -= take
        return _Tensor(shape, flats[0].parts[0].dtype if flats[0].parts else torch.float32, pieces)

    @staticmethod
    def _moments(zero: dict, state: str) -> list[torch.Tensor] | None:
        """The per-group tensors of Adam state `state` in this rank's file, or None."""
        inner = zero.get("optimizer_state_dict") or zero.get("base_optimizer_state")
        if isinstance(inner, list):  # stage 1/2 elastic: one lean state per group
            groups = [g.get(state) if isinstance(g, dict) else None for g in inner]
        elif isinstance(inner, dict) and isinstance(inner.get("state"), dict) and all(
                isinstance(k, int) for k in inner["state"]):
            groups = [s.get(state) if isinstance(s, dict) else None
                      for _, s in sorted(inner["state"].items())]
        else:
            return None
        ok = groups and all(isinstance(g, torch.Tensor) and g.is_floating_point() for g in groups)
        return groups if ok else None

    def _read_stage12(self, model: dict, zeros: list[dict], model_file: Path) -> None:
        group_shapes = _group_shapes(model, model_file)
        parts = [_tensors(z.get("single_partition_of_fp32_groups"), f,
                          "'single_partition_of_fp32_groups'") for z, f in zip(zeros, self._files)]
        for rank_parts, path in zip(parts, self._files):
            self._check_not_offloaded(rank_parts)
            if len(rank_parts) != len(group_shapes):
                raise _damaged(path, f"{len(rank_parts)} fp32 partitions for "
                                     f"{len(group_shapes)} param groups")
        families = {"weight": parts}
        for state in ADAM_STATES:
            moments = [self._moments(z, state) for z in zeros]
            if all(m is not None and len(m) == len(group_shapes) for m in moments):
                families[state] = moments
        align = 2 * self.world_size  # DeepSpeed pads each group's flat vector to a multiple of it
        for g, shapes in enumerate(group_shapes):
            flats = {kind: _Flat([rank[g] for rank in ranks]) for kind, ranks in families.items()}
            offset = 0
            for name, shape in shapes.items():
                numel = math.prod(shape)
                for kind, flat in flats.items():
                    key = name if kind == "weight" else optimizer_state_name(kind, name)
                    self._tensors[key] = _span(flat, [(offset, numel)], shape, flat.parts[0].dtype)
                offset += numel
            for kind, flat in flats.items():
                available = flat.numel
                padded = align * math.ceil(offset / align)
                if available < offset or padded != align * math.ceil(available / align):
                    raise CheckpointError(f"{self.path}: param group {g} takes {offset} elements "
                                          f"but its fp32 partitions hold {available} ({kind}): "
                                          f"files from different runs?")

    def _add_model_entries(self, models: list[dict], files: list[Path]) -> None:
        """Buffers, frozen parameters and tied aliases, from the model states files."""
        model, path = models[0], files[0]
        module = _dict(model, "module", path, optional=True)
        trainable = {k for group in _group_shapes(model, path) for k in group}
        shared = _dict(model, "shared_params", path, optional=True)
        buffer_names = model.get("buffer_names") or []
        if not isinstance(buffer_names, list | tuple):
            raise _damaged(path, "'buffer_names' is not a list")
        for name in buffer_names:
            if name in module:
                self._tensors[_name(name, path)] = _whole(self._module_tensor(module, name, path))
        frozen_shapes = _shapes(model.get("frozen_param_shapes") or {}, path,
                                "'frozen_param_shapes'")
        if self.zero_stage == 3:
            for name, shape in frozen_shapes.items():
                pieces = []
                for m, f in zip(models, files):
                    fragment = _dict(m, "frozen_param_fragments", f).get(name)
                    if not isinstance(fragment, torch.Tensor):
                        raise _damaged(f, f"no fragment of frozen parameter {name!r}")
                    pieces.append(fragment)
                fragments = _Flat(pieces)
                if fragments.numel < math.prod(shape):
                    raise _damaged(path, f"frozen parameter {name!r} of shape {tuple(shape)} has "
                                         f"{fragments.numel} elements in all ranks' fragments")
                self._tensors[name] = _span(fragments, [(0, math.prod(shape))], shape,
                                            fragments.parts[0].dtype)
        else:
            fragments = _dict(model, "frozen_param_fragments", path, optional=True)
            for name in module:  # stage 1/2 keep every weight whole in `module`
                if name not in trainable and name not in self._tensors and name not in shared:
                    source = fragments if name in fragments else module
                    tensor = self._module_tensor(source, name, path)
                    self._tensors[_name(name, path)] = _whole(tensor)
        for alias, owner in shared.items():
            if owner not in self._tensors:
                raise CheckpointError(f"{self.path}: tied parameter {alias!r} points at {owner!r}, "
                                      f"which the checkpoint does not hold")
            self._tensors[_name(alias, path)] = self._tensors[owner]

    @staticmethod
    def _module_tensor(module: dict, name: str, path: Path) -> torch.Tensor:
        value = module[name]
        if not isinstance(value, torch.Tensor):
            raise _damaged(path, f"{name!r} is {type(value).__name__}, not a tensor")
        return value

    @staticmethod
    def _adam_step(zero: dict) -> int | None:
        """Adam's step count (bias correction needs it to resume), from the first group."""
        inner = zero.get("optimizer_state_dict") or zero.get("base_optimizer_state")
        states = inner.get("state") if isinstance(inner, dict) else None
        if isinstance(inner, list):
            states = dict(enumerate(inner))
        for state in (states.values() if isinstance(states, dict) else ()):
            step = state.get("step") if isinstance(state, dict) else None
            if isinstance(step, torch.Tensor) and step.numel() == 1:
                step = step.item()
            if isinstance(step, int | float) and math.isfinite(step):
                return int(step)
        return None

    def _metadata(self, model: dict, zero: dict) -> dict[str, Any]:
        """JSON facts about the run (steps, versions, config) for a converted checkpoint."""
        scaler = zero.get("loss_scaler")
        facts = {
            "source": "deepspeed", "zero_stage": self.zero_stage, "world_size": self.world_size,
            "bf16": self._prefix == "bf16_", "ds_version": model.get("ds_version"),
            "global_steps": model.get("global_steps"), "global_samples": model.get("global_samples"),
            "skipped_steps": model.get("skipped_steps"),
            "loss_scale": getattr(scaler, "cur_scale", None), "ds_config": model.get("ds_config"),
            "optimizer_step": self._adam_step(zero), "lr_scheduler": model.get("lr_scheduler"),
        }
        for key, value in list(facts.items()):
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError, RecursionError):
                facts[key] = str(value)[:1000]
        return facts
