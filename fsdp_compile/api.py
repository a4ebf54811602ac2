"""Public policies of ``fully_shard`` (mixed precision, offloading)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import torch

__all__ = [
    "MixedPrecisionPolicy",
    "CommPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "ShardingStrategy",
    "BackwardPrefetch",
    "MixedPrecision",
    "CPUOffload",
    "StateDictType",
    "StateDictConfig",
    "FullStateDictConfig",
    "LocalStateDictConfig",
    "ShardedStateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "OptimStateKeyType",
    "StateDictSettings",
]


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


@dataclass(frozen=True)
class CommPolicy:
    """What one ``fully_shard`` group puts on the wire, beyond :class:`MixedPrecisionPolicy`.

    Args:
        all_gather_dtype: ``torch.int8`` or ``torch.float8_e4m3fn``: parameters are all-gathered
            block-quantized (one float32 absmax scale per ``block_size`` elements, sent beside
            the data), and forward and backward compute with the dequantized weights, which
            the gradient treats as the parameter; the optimizer keeps the full-precision shards.
            Error per element: int8 at most half the block's scale (absmax / 127); e4m3 at most
            ``2**-4 * |x| + 2**-10 * scale`` (scale = absmax / 448). ``None``: ``param_dtype``.
        block_size: elements per scale (default 128); scales add ``4 / block_size`` bytes per element.
        reduce_wire_dtype: gradients travel in this dtype (e.g. ``torch.bfloat16``), as an
            all-to-all of each rank's chunks instead of a reduce-scatter; every rank then sums
            what it received in ``reduce_accumulate_dtype``, its own chunk unrounded (it never
            travels), so the result is the float32 sum of the rounded contributions of the other
            ranks and this rank's own (no rounding at every hop, as a bf16 reduce-scatter has).
        reduce_accumulate_dtype: dtype of that sum (float32 by default).

    Example::

        fully_shard(block, comm_policy=CommPolicy(all_gather_dtype=torch.int8,
                                                  reduce_wire_dtype=torch.bfloat16))
    """

    all_gather_dtype: torch.dtype | None = None
    block_size: int = 128
    reduce_wire_dtype: torch.dtype | None = None
    reduce_accumulate_dtype: torch.dtype = torch.float32

    def check(self, label: str) -> None:
        """Raise a clear error for a policy that cannot apply (at ``fully_shard``, before any collective)."""
        where = f"fully_shard({label}): CommPolicy"
        quantized = tuple(d for d in (torch.int8, getattr(torch, "float8_e4m3fn", None)) if d is not None)
        if self.all_gather_dtype is not None and self.all_gather_dtype not in quantized:
            missing = " (this torch has no torch.float8_e4m3fn; use torch.int8 or a newer torch)" if not hasattr(torch, "float8_e4m3fn") else ""
            raise ValueError(f"{where}.all_gather_dtype must be torch.int8 or torch.float8_e4m3fn, got {self.all_gather_dtype}{missing}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1 or self.block_size % 16:
            raise ValueError(
                f"{where}.block_size must be a positive multiple of 16 (whole 16-byte rows of int8 / fp8 data), "
                f"got {self.block_size!r}; 128 or 256 are usual"
            )
        if self.reduce_wire_dtype is not None and not self.reduce_wire_dtype.is_floating_point:
            raise ValueError(f"{where}.reduce_wire_dtype must be a floating-point dtype such as torch.bfloat16, got {self.reduce_wire_dtype}")
        if not self.reduce_accumulate_dtype.is_floating_point:
            raise ValueError(f"{where}.reduce_accumulate_dtype must be floating point, got {self.reduce_accumulate_dtype}")
        if self.reduce_accumulate_dtype != torch.float32 and self.reduce_wire_dtype is not None:
            raise ValueError(f"{where}.reduce_accumulate_dtype: only torch.float32 sums are implemented, got {self.reduce_accumulate_dtype}")

    @property
    def quantizes_all_gather(self) -> bool:
        return self.all_gather_dtype is not None


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


# --- FSDP1 names --------------------------------------------------------------------------------
# [Note: FSDP1 names are mappings, not a second runtime]
# FSDP1 configured one wrapper class with enums; here each enum value maps onto fully_shard
# arguments (or an FSDPModule setter), so an FSDP1 user gets FSDP1's behaviour from the one
# runtime. ``fsdp1_kwargs`` (fsdp1.py) is the mapping; ``FSDPModule.set_backward_prefetch`` the one knob
# that is not a fully_shard argument.


class ShardingStrategy(Enum):
    """FSDP1's sharding strategies, and the ``fully_shard`` arguments each becomes (``fsdp1_kwargs``).

    - ``FULL_SHARD``: shard over all ranks, ``reshard_after_forward=True`` (parameters
      all-gathered again in backward).
    - ``SHARD_GRAD_OP``: shard over all ranks, ``reshard_after_forward=False`` (parameters stay
      unsharded from forward until the end of their backward; ZeRO-2).
    - ``NO_SHARD``: replicate (DDP): a 2-D mesh ``(world, 1)``, i.e. shard groups of one rank;
      gradients are all-reduced across the replicas.
    - ``HYBRID_SHARD``: a 2-D ``(replicate, shard)`` mesh, shard within a node and replicate across
      nodes, ``reshard_after_forward=True``.
    - ``_HYBRID_SHARD_ZERO2``: ``HYBRID_SHARD`` with ``reshard_after_forward=False``.
    """

    FULL_SHARD = auto()
    SHARD_GRAD_OP = auto()
    NO_SHARD = auto()
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()


class BackwardPrefetch(Enum):
    """When a group's backward all-gathers the next group's parameters (``set_backward_prefetch``).

    - ``BACKWARD_PRE`` (the default, FSDP2's behaviour): in the current group's pre-backward, before
      its gradient computation; overlaps the next all-gather with that computation, holding two
      groups' unsharded parameters at once.
    - ``BACKWARD_POST``: in the current group's post-backward, right before its reduce-scatter; the
      current gradient computation is not overlapped, peak memory is lower.
    - ``None`` (pass ``None`` instead of a member): no backward prefetch; each group all-gathers
      when its own backward starts (explicit ``set_modules_to_backward_prefetch`` lists included).
    """

    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


@dataclass
class MixedPrecision:
    """FSDP1's mixed-precision config; ``to_policy()`` gives the ``MixedPrecisionPolicy`` it maps to.

    ``cast_forward_inputs`` or ``cast_root_forward_inputs`` map to
    ``MixedPrecisionPolicy.cast_forward_inputs`` (every group casts its floating-point inputs to
    ``param_dtype``; with one ``param_dtype`` for all groups that is what FSDP1's root cast did).
    ``buffer_dtype`` and ``keep_low_precision_grads=True`` have no FSDP2 counterpart and are refused.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True

    def to_policy(self) -> MixedPrecisionPolicy:
        if self.buffer_dtype is not None:
            raise ValueError(
                "MixedPrecision(buffer_dtype=...) has no fully_shard counterpart: buffers are not managed. "
                "Cast the buffers yourself (e.g. module.buffers()) and leave buffer_dtype=None."
            )
        if self.keep_low_precision_grads:
            raise ValueError(
                "MixedPrecision(keep_low_precision_grads=True) is not supported: gradients are reduced in "
                "reduce_dtype and stored in the parameters' dtype. Use keep_low_precision_grads=False."
            )
        return MixedPrecisionPolicy(
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            cast_forward_inputs=self.cast_forward_inputs or self.cast_root_forward_inputs,
        )


@dataclass
class CPUOffload:
    """FSDP1's CPU offload: ``offload_params=True`` maps to ``CPUOffloadPolicy()`` (parameters and
    gradients on CPU, optimizer step on CPU), ``False`` to ``OffloadPolicy()``."""

    offload_params: bool = False

    def to_policy(self) -> OffloadPolicy:
        return CPUOffloadPolicy() if self.offload_params else OffloadPolicy()


class StateDictType(Enum):
    """Which state dict ``module.state_dict()`` returns and ``load_state_dict`` takes (see
    ``fsdp_compile.state_dict_type``).

    - ``SHARDED_STATE_DICT`` (the default, FSDP2's): ``DTensor`` values under the original names;
      what ``torch.distributed.checkpoint`` saves and loads at any world size.
    - ``FULL_STATE_DICT``: plain full tensors (all-gathered); see :class:`FullStateDictConfig`.
    - ``LOCAL_STATE_DICT``: this rank's padded shard of each parameter as a plain tensor of shape
      ``(ceil(dim0 / shard_world_size), *shape[1:])``; loadable only at the same world size.
    """

    FULL_STATE_DICT = auto()
    LOCAL_STATE_DICT = auto()
    SHARDED_STATE_DICT = auto()


@dataclass
class StateDictConfig:
    """Base of the state-dict configs. ``offload_to_cpu``: return the values as CPU tensors."""

    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """``rank0_only``: saving, only rank 0 gets the values (the other ranks an empty dict, they
    still take part in the all-gathers); loading, only rank 0's dict is read and broadcast.
    ``rank0_only=True, offload_to_cpu=True`` is the memory-friendly way to write one file."""

    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    pass


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    pass


@dataclass
class OptimStateDictConfig:
    """Base of the optimizer state-dict configs (``fsdp_compile.optim_state_dict``).

    ``offload_to_cpu``: return the state's tensors on CPU. FSDP1's default is ``True`` for the
    full and sharded kinds, ``False`` for the local one.
    """

    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    """``rank0_only``: saving, only rank 0 gets the full optimizer state (the other ranks an empty
    dict, they still take part in the all-gathers); loading, only rank 0's dict is read and
    broadcast, the other ranks may pass ``{}``."""

    rank0_only: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    offload_to_cpu: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    pass


class OptimStateKeyType(Enum):
    """What the keys of an optimizer state dict's ``"state"`` (and its groups' ``"params"``) are.

    - ``PARAM_NAME``: parameter FQNs (``"layers.0.attention.wq.weight"``), what
      ``optim_state_dict`` returns; independent of the optimizer's parameter order.
    - ``PARAM_ID``: positions in the optimizer's parameter order, what
      ``torch.optim.Optimizer.state_dict()`` gives and ``load_state_dict`` takes.
    """

    PARAM_NAME = auto()
    PARAM_ID = auto()


@dataclass(frozen=True)
class StateDictSettings:
    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig
