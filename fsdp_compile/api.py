"""Public policies of ``fully_shard`` (mixed precision, offloading)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes used around one ``fully_shard`` group; ``None`` keeps the parameter's own dtype.

    Args:
        param_dtype: dtype of the unsharded parameters used in forward/backward (and of the
            all-gather). The sharded parameters and the optimizer keep their original dtype.
        reduce_dtype: dtype of the gradient reduce-scatter / all-reduce. Defaults to
            ``param_dtype``.
        output_dtype: dtype the module's floating-point outputs are cast to.
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.

    Example::

        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                          reduce_dtype=torch.float32))
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state stay on the mesh device."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients on CPU; copy them to the device around collectives.

    Args:
        pin_memory: pin the CPU shards so host-device copies can be asynchronous.
    """

    pin_memory: bool = True
