"""`deepspeed.zero`: `Init` (parameters created straight into the store by `initialize`) and
`GatheredParameters` (real values in a block, changes written back), with DeepSpeed's
signatures."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from infinity import zero
from infinity.engine import gathered


class Init(zero.Init):
    """`with deepspeed.zero.Init(config_dict_or_path=...):` around model construction: each
    parameter goes to the meta device as it is registered, and `initialize` creates the values
    unit by unit in the store (docs/scale.md). The config given to `initialize` decides
    precision and placement; `dtype`, `remote_device`, `pin_memory` and the process-group
    arguments are accepted for DeepSpeed's signature and change nothing."""

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: Any = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
    ) -> None:
        if module is not None:
            raise NotImplementedError(
                "zero.Init(module=...): a built module is not partitioned afterwards; "
                "build the model inside `with zero.Init(...)`, or pass it to initialize"
            )
        if mpu is not None:
            raise NotImplementedError("zero.Init(mpu=...): Infinity has no model parallelism")
        if zero_quantized_weights or zero_quantized_nontrainable_weights:
            raise NotImplementedError("zero.Init: quantized weights (ZeRO++) are not supported")
        super().__init__(
            config_dict_or_path if config_dict_or_path is not None else config, enabled=enabled
        )


class GatheredParameters:
    """`with deepspeed.zero.GatheredParameters(params, modifier_rank=None):` the parameters of a
    model given to `initialize` hold their real values inside the block; with `modifier_rank`,
    that rank's values are written back to the store on a normal exit (every rank's store, at
    every stage). Parameters no engine holds are left alone. Every rank enters the block with
    the same parameters. See infinity/engine/_gathered.py."""

    def __init__(
        self,
        params: torch.Tensor | Iterable[torch.Tensor],
        modifier_rank: int | None = None,
        fwd_module: torch.nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        if fwd_module is not None:
            raise NotImplementedError(
                "GatheredParameters(fwd_module=...): external parameters are not "
                "registered; use the parameters inside the block only"
            )
        self._context = gathered(params, modifier_rank) if enabled else None

    def __enter__(self) -> None:
        if self._context is not None:
            self._context.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        if self._context is not None:
            return self._context.__exit__(*exc)
        return None
