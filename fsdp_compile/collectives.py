"""Grouped collectives: one all-gather and one reduce-scatter (plus the HSDP all-reduce) per group.

Each goes through the copy-in / copy-out custom ops of ``fsdp_compile.kernels`` (the seam the
Triton kernels plug into). Collectives are issued with ``async_op=True``; a ``Pending*``
object is waited on at first use (see [Note: overlap without streams] in device.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from fsdp_compile.device import DeviceHandle
from fsdp_compile.kernels import ops

__all__ = [
    "CollectiveRecord",
    "record_collectives",
    "PendingAllGather",
    "PendingReduceScatter",
    "PendingPackedAllGather",
    "issue_all_gather",
    "issue_packed_all_gather",
    "issue_reduce_scatter",
    "gradient_divide_factors",
]

# torch 2.13 renamed the tensor collectives; 2.11 has only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as issued: its kind, the group's label, bytes moved from this rank and why."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    group: str  # the group's label; for the per-parameter gathers of state dicts and
    # unshard_params, the parameter's name inside its fully_shard module
    numel: int
    dtype: torch.dtype
    # "forward", "forward-prefetch", "backward", "backward-prefetch", "explicit", "state_dict",
    # "unshard_params", "unshard_params-grad"
    reason: str


_active_recorders: list[list[CollectiveRecord]] = []


@contextlib.contextmanager
def record_collectives() -> Iterator[list[CollectiveRecord]]:
    """Record every collective the runtime issues in this process, in issue order.

    Example::

        with fsdp_compile.record_collectives() as log:
            model(x).sum().backward()
        print([(r.kind, r.group) for r in log])
    """
    log: list[CollectiveRecord] = []
    _active_recorders.append(log)
    try:
        yield log
    finally:
        _active_recorders.remove(log)


def record(record: CollectiveRecord) -> None:
    """Append ``record`` to every open ``record_collectives()`` log."""
    for log in _active_recorders:
        log.append(record)


def _raise_collective_error(kind: str, label: str, error: BaseException) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    raise RuntimeError(
        f"fsdp_compile: {kind} of the fully_shard group '{label}' failed on rank {rank}: {error}. "
        "Another rank probably died or did not reach this collective (all ranks must run the same "
        "forward/backward); its own log has the first error."
    ) from error


def gradient_divide_factors(data_parallel_size: int, custom_factor: float | None) -> tuple[float, float]:
    """(pre-divide, post-divide) so gradients end up averaged without overflowing low precision.

    Dividing by about sqrt(world) before and after the sum keeps fp16/bf16 sums in range;
    powers of two keep the division exact. A custom factor divides once, before the sum.
    """
    if custom_factor is not None:
        return float(custom_factor), 1.0
    pre = 1
    while data_parallel_size % pre == 0 and data_parallel_size / pre > pre:
        pre *= 2
    return float(pre), data_parallel_size / pre


def _wait(work: dist.Work | None, kind: str, label: str) -> None:
    if work is not None:
        try:
            work.wait()
        except Exception as error:  # noqa: BLE001 - rewrapped with the group's name
            _raise_collective_error(kind, label, error)


@dataclass
class PendingAllGather:
    work: dist.Work | None
    output: torch.Tensor  # [world, group_numel]
    label: str

    def wait(self) -> torch.Tensor:
        _wait(self.work, "all-gather", self.label)
        self.work = None
        return self.output


def issue_all_gather(
    shards: list[torch.Tensor],
    padded_numels: list[int],
    dtype: torch.dtype,
    group: dist.ProcessGroup,
    world_size: int,
    rank: int,
    device: torch.device,
    device_handle: DeviceHandle,
    label: str,
    reason: str,
    wait_event: torch.Event | None = None,
) -> PendingAllGather:
    """Copy this rank's shards into its row of a new ``[world, group_numel]`` buffer and all-gather it."""
    total = sum(padded_numels)
    output = torch.empty((world_size, total), dtype=dtype, device=device)
    stream = device_handle.side_stream("all_gather")
    with device_handle.on_stream(stream):
        device_handle.wait_event(wait_event, stream)
        ops.all_gather_copy_in(shards, padded_numels, output[rank])
        record(CollectiveRecord("all_gather", label, total, dtype, reason))
        if world_size == 1:
            return PendingAllGather(None, output, label)
        try:
            work = all_gather_single(output.view(-1), output[rank], group=group, async_op=True)
        except Exception as error:  # noqa: BLE001
            _raise_collective_error("all-gather", label, error)
    return PendingAllGather(work, output, label)


# Byte offsets of packed inputs are multiples of this, so every output can be viewed in its dtype.
_PACKED_ALIGNMENT = 16


@dataclass
class PendingPackedAllGather:
    """A packed all-gather in flight (``issue_packed_all_gather``) and how to unpack it."""

    work: dist.Work | None
    output: torch.Tensor  # uint8 [world, total_bytes]
    inputs: list[list[torch.Tensor]]  # per parameter, what this rank sent (shapes and dtypes)
    offsets: list[list[int]]
    label: str

    def wait_into(self, outputs: list[list[torch.Tensor]]) -> None:
        """Copy each input's gathered rows (rank-major, dim-0 concat) into ``outputs`` (same nesting)."""
        _wait(self.work, "all-gather", self.label)
        self.work = None
        world = self.output.shape[0]
        for sent, starts, targets in zip(self.inputs, self.offsets, outputs):
            for tensor, start, target in zip(sent, starts, targets):
                nbytes = tensor.numel() * tensor.element_size()
                rows = self.output[:, start : start + nbytes].view(tensor.dtype)
                target.view(world, -1).copy_(rows)


def issue_packed_all_gather(
    inputs: list[list[torch.Tensor]],
    group: dist.ProcessGroup,
    world_size: int,
    rank: int,
    device: torch.device,
    device_handle: DeviceHandle,
    label: str,
    reason: str,
) -> PendingPackedAllGather:
    """One all-gather of tensors of any dtypes and shapes, sent as bytes in one buffer.

    For groups with an all-gather extension (see [Note: all-gather extensions] in param.py),
    whose inputs may be several tensors per parameter in several dtypes (e.g. int8 data and
    bf16 scales). Every rank must send the same shapes.
    """
    offsets, total = [], 0
    for sent in inputs:
        starts = []
        for tensor in sent:
            starts.append(total)
            total += -(-tensor.numel() * tensor.element_size() // _PACKED_ALIGNMENT) * _PACKED_ALIGNMENT
        offsets.append(starts)
    output = torch.empty((world_size, total), dtype=torch.uint8, device=device)
    stream = device_handle.side_stream("all_gather")
    with device_handle.on_stream(stream):
        row = output[rank]
        for sent, starts in zip(inputs, offsets):
            for tensor, start in zip(sent, starts):
                raw = tensor.reshape(-1).view(torch.uint8)
                row[start : start + raw.numel()].copy_(raw)
        record(CollectiveRecord("all_gather", label, total, torch.uint8, reason))
        work = None
        if world_size > 1:
            try:
                work = all_gather_single(output.view(-1), row, group=group, async_op=True)
            except Exception as error:  # noqa: BLE001
                _raise_collective_error("all-gather", label, error)
    return PendingPackedAllGather(work, output, inputs, offsets, label)


@dataclass
class PendingReduceScatter:
    work: dist.Work | None
    output: torch.Tensor  # [group_numel] this rank's reduced shard
    label: str
    keep_alive: list[torch.Tensor] = field(default_factory=list)

    def wait(self) -> torch.Tensor:
        _wait(self.work, "reduce-scatter", self.label)
        self.work = None
        self.keep_alive.clear()
        return self.output


def issue_reduce_scatter(
    grads: list[torch.Tensor],
    padded_numels: list[int],
    reduce_dtype: torch.dtype,
    group: dist.ProcessGroup,
    world_size: int,
    pre_divide: float,
    device: torch.device,
    device_handle: DeviceHandle,
    label: str,
) -> PendingReduceScatter:
    """Lay unsharded gradients into a ``[world, group_numel]`` buffer and reduce-scatter (sum) it."""
    total = sum(padded_numels)
    stream = device_handle.side_stream("reduce_scatter")
    with device_handle.on_stream(stream):
        reduce_input = torch.empty((world_size, total), dtype=reduce_dtype, device=device)
        ops.reduce_scatter_copy_in(grads, padded_numels, reduce_input, pre_divide)
        for grad in grads:
            # The compute stream frees these grads once we return; the copy-in may still read them.
            device_handle.keep_alive_on(grad, stream)
        record(CollectiveRecord("reduce_scatter", label, total * world_size, reduce_dtype, "backward"))
        if world_size == 1:
            return PendingReduceScatter(None, reduce_input.view(-1), label)
        output = torch.empty((total,), dtype=reduce_dtype, device=device)
        try:
            work = _reduce_scatter_single(output, reduce_input.view(-1), group=group, async_op=True)
        except Exception as error:  # noqa: BLE001
            _raise_collective_error("reduce-scatter", label, error)
    return PendingReduceScatter(work, output, label, keep_alive=[reduce_input])


def all_reduce_replicas(tensor: torch.Tensor, group: dist.ProcessGroup, label: str) -> None:
    """HSDP: sum the reduce-scattered shard across replicas (blocking)."""
    record(CollectiveRecord("all_reduce", label, tensor.numel(), tensor.dtype, "backward"))
    try:
        dist.all_reduce(tensor, group=group)
    except Exception as error:  # noqa: BLE001
        _raise_collective_error("all-reduce", label, error)
