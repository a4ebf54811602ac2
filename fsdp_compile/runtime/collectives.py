"""Grouped collectives: one all-gather and one reduce-scatter (plus the HSDP all-reduce) per group.

Each goes through the copy-in / copy-out custom ops of ``fsdp_compile.kernels`` (the seam the
Triton kernels plug into). Collectives are issued with ``async_op=True``; a ``Pending*``
object is waited on at first use (see [Note: overlap without streams] in device.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from fsdp_compile.runtime.comm_context import CommContext
from fsdp_compile.kernels import ops, quantized, quantized_reference
from fsdp_compile.runtime.layout import ShardLayout
from fsdp_compile.runtime.mesh import MeshInfo, ShardGroup

__all__ = [
    "CollectiveRecord",
    "record_collectives",
    "PendingAllGather",
    "PendingReduceScatter",
    "pending_functional_reduce_scatter",
    "PendingPackedAllGather",
    "issue_all_gather",
    "wait_and_drop",
    "issue_packed_all_gather",
    "issue_quantized_all_gather",
    "PendingQuantizedAllGather",
    "issue_reduce_scatter",
    "gradient_divide_factors",
    "ReduceSpec",
    "gather_full",
]

# torch 2.13 renamed the tensor collectives; 2.11 has only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as issued: its kind, the group's label, bytes moved from this rank and why."""

    kind: str  # "all_gather" | "reduce_scatter" (an all-to-all with a CommPolicy's gradient wire) | "all_reduce"
    group: str  # the group's label; for the per-parameter gathers of state dicts and
    # unshard_params, the parameter's name inside its fully_shard module
    numel: int
    dtype: torch.dtype
    # "forward", "forward-prefetch", "backward", "backward-prefetch", "explicit", "state_dict",
    # "unshard_params", "unshard_params-grad", "block-frame-forward", "block-frame-backward"
    reason: str

    @property
    def nbytes(self) -> int:
        """Bytes of the collective's buffer on this rank, in its wire dtype (``numel * itemsize``)."""
        return self.numel * self.dtype.itemsize


# The open record_collectives() blocks, innermost last: a process-wide observer stack, as the collectives are.
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


@dataclass(frozen=True)
class ReduceSpec:
    """How one group's gradients are reduced: the eager reduce-scatter and the traced one both
    follow it, so their arithmetic cannot drift apart. Plain values only (process groups by name),
    so Dynamo can hold it as a constant and guard on it."""

    reduce_dtype: torch.dtype
    grad_dtype: torch.dtype  # the sharded gradient's: the parameters' own dtype
    pre_divide: float
    post_divide: float
    shard_size: int
    shard_group_name: str
    replicate_size: int
    replicate_group_name: str | None  # HSDP: the all-reduce across replicas
    # CommPolicy.reduce_wire_dtype: the chunks travel in this dtype by all-to-all and each rank sums
    # what it received in float32 (then ``reduce_dtype`` is float32 and ``pre_divide`` 1: the one
    # divide comes after the float32 sum).
    wire_dtype: torch.dtype | None = None

    @staticmethod
    def for_group(
        mesh_info: MeshInfo, reduce_dtype: torch.dtype, grad_dtype: torch.dtype, divide_factor: float | None,
        wire_dtype: torch.dtype | None = None,
    ) -> "ReduceSpec":
        pre_divide, post_divide = gradient_divide_factors(mesh_info.data_parallel_size, divide_factor)
        if wire_dtype is not None:
            pre_divide, post_divide, reduce_dtype = 1.0, pre_divide * post_divide, torch.float32
        replicate = mesh_info.replicate_group
        return ReduceSpec(
            reduce_dtype, grad_dtype, pre_divide, post_divide, mesh_info.shard_size, mesh_info.shard_group.group_name,
            mesh_info.replicate_size, None if replicate is None else replicate.group_name, wire_dtype,
        )

    @property
    def reduce_input_dtype(self) -> torch.dtype:
        """The dtype gradients are laid out in for the collective: the wire's when set."""
        return self.wire_dtype if self.wire_dtype is not None else self.reduce_dtype


def _allocate(custom: Any, size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A communication buffer: from a custom ``Comm``'s ``allocate`` when set, else the caching allocator."""
    if custom is None:
        return torch.empty(size, dtype=dtype, device=device)
    return custom.allocate(size, dtype=dtype, device=device)


def _wait(work: dist.Work | None, kind: str, label: str) -> None:
    if work is not None:
        try:
            work.wait()
        except Exception as error:  # noqa: BLE001 - rewrapped with the group's name
            _raise_collective_error(kind, label, error)


@dataclass
class PendingAllGather:
    """An all-gather in flight; see [Note: stream protocol] in comm_context.py."""

    work: dist.Work | None
    output: torch.Tensor  # [world, group_numel]
    label: str
    event: Any  # marks the all-gather on its stream (None without streams)
    overlapped: bool  # issued on the side streams (implicit forward/backward all-gathers)

    def wait(self, comm: CommContext) -> torch.Tensor:
        """The gathered buffer, with the current stream ordered after the all-gather."""
        _wait(self.work, "all-gather", self.label)
        self.work = None
        comm.handle.wait_event(comm.handle.current_stream(), self.event)
        return self.output


def wait_and_drop(pending: "PendingAllGather | PendingReduceScatter", comm: CommContext) -> None:
    """Let a collective of an aborted step complete (its buffer is in use until then), then forget
    it. A failure of the collective itself is not raised again: the step already failed."""
    try:
        pending.wait(comm)
    except RuntimeError:
        pass


def issue_all_gather(
    shards: list[torch.Tensor],
    padded_numels: list[int],
    dtype: torch.dtype,
    group: ShardGroup,
    comm: CommContext,
    label: str,
    reason: str,
    custom: Any = None,
) -> PendingAllGather:
    """Copy this rank's shards (cast, padded) into its row of a new ``[world, group_numel]`` buffer and all-gather it.

    ``custom``: an FSDP2 ``AllGather`` (``set_custom_all_gather``) that allocates the buffer and runs the collective.
    """
    return _issue_all_gather(
        sum(padded_numels), dtype, lambda row: ops.all_gather_copy_in(shards, padded_numels, row), group, comm, label,
        reason, custom,
    )


def _issue_all_gather(
    total: int, dtype: torch.dtype, copy_in: Callable[[torch.Tensor], None], group: ShardGroup, comm: CommContext,
    label: str, reason: str, custom: Any,
) -> PendingAllGather:
    streams = comm.all_gather_streams(reason)
    with comm.handle.on_stream(streams[0], "all_gather_copy_in"):
        output = _allocate(custom, (group.shard_size, total), dtype, comm.device)
        copy_in(output[group.shard_rank])
    comm.handle.wait_stream(streams[1], streams[0])
    return _gather_rows(output, dtype, group, comm, streams, label, reason, custom)


def _gather_rows(
    output: torch.Tensor, wire_dtype: torch.dtype, group: ShardGroup, comm: CommContext, streams: tuple[Any, Any],
    label: str, reason: str, custom: Any = None,
) -> PendingAllGather:
    """All-gather the ``[world, numel]`` buffer whose row this rank's copy-in wrote, on the
    all-gather stream of ``streams`` (copy-in stream, all-gather stream); recorded in ``wire_dtype``."""
    handle, all_gather_stream = comm.handle, streams[1]
    record(CollectiveRecord("all_gather", label, output.shape[1], wire_dtype, reason))
    work = None
    with handle.on_stream(all_gather_stream, "all_gather"):
        if group.shard_size > 1 or custom is not None:
            run = custom if custom is not None else all_gather_single
            try:
                work = run(output.view(-1), output[group.shard_rank], group=group.shard_group, async_op=True)
            except Exception as error:  # noqa: BLE001
                _raise_collective_error("all-gather", label, error)
        event = handle.record_event(all_gather_stream, "all_gather")
    return PendingAllGather(work, output, label, event, streams[0] is comm.all_gather_copy_in_stream)


# Byte offsets of packed inputs are multiples of this, so every output can be viewed in its dtype.
_PACKED_ALIGNMENT = 16


@dataclass
class PendingPackedAllGather:
    """A packed all-gather in flight (``issue_packed_all_gather``) and how to unpack it."""

    pending: PendingAllGather  # of the uint8 [world, total_bytes] buffer
    inputs: list[list[torch.Tensor]]  # per parameter, what this rank sent (shapes and dtypes)
    offsets: list[list[int]]

    def wait_into(self, outputs: list[list[torch.Tensor]], comm: CommContext) -> None:
        """Copy each input's gathered rows (rank-major, dim-0 concat) into ``outputs`` (same nesting)."""
        gathered = self.pending.wait(comm)
        world = gathered.shape[0]
        for sent, starts, targets in zip(self.inputs, self.offsets, outputs):
            for tensor, start, target in zip(sent, starts, targets):
                nbytes = tensor.numel() * tensor.element_size()
                target.view(world, -1).copy_(gathered[:, start : start + nbytes].view(tensor.dtype))


def issue_packed_all_gather(
    inputs: list[list[torch.Tensor]], group: ShardGroup, comm: CommContext, label: str, reason: str, custom: Any = None
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

    def copy_in(row: torch.Tensor) -> None:
        for sent, starts in zip(inputs, offsets):
            for tensor, start in zip(sent, starts):
                raw = tensor.reshape(-1).view(torch.uint8)
                row[start : start + raw.numel()].copy_(raw)

    pending = _issue_all_gather(total, torch.uint8, copy_in, group, comm, label, reason, custom)
    return PendingPackedAllGather(pending, inputs, offsets)


@dataclass
class PendingReduceScatter:
    """A reduce-scatter in flight; see [Note: stream protocol] in comm_context.py."""

    work: dist.Work | None
    output: torch.Tensor  # [group_numel] this rank's reduced shard; the gradient wire's [world, group_numel] rows
    label: str
    event: Any
    keep_alive: list[torch.Tensor] = field(default_factory=list)
    # The gradient wire's float32 own chunk, which stands in for row ``own_rank`` of ``output``.
    own_row: torch.Tensor | None = None
    own_rank: int = 0

    def wait(self, comm: CommContext) -> torch.Tensor:
        _wait(self.work, "reduce-scatter", self.label)
        self.work = None
        comm.handle.wait_event(comm.handle.current_stream(), self.event)
        self.keep_alive.clear()
        return self.output


class _FunctionalCollectiveWork:
    """A functional collective's output (``torch.ops._c10d_functional``) as a pending collective's
    ``work``: waited on by ``wait_tensor``."""

    def __init__(self, output: torch.Tensor) -> None:
        self.output = output

    def wait(self) -> None:
        torch.ops._c10d_functional.wait_tensor(self.output)


def pending_functional_reduce_scatter(output: torch.Tensor, reduce_input: torch.Tensor, label: str) -> PendingReduceScatter:
    """A compiled graph's reduce-scatter still in flight, handed over un-waited, as the eager runtime's
    pending one; ``reduce_input`` is kept until the wait (the collective may read it until then).

    ``output`` is a plain reduce-scatter's result (never the gradient wire's rows), waited as it is
    and read flat: a bucket's is flat already, one parameter's unbucketed keeps its dim-0 shard's
    shape, which the copy-out would take for the wire's rows."""
    return PendingReduceScatter(_FunctionalCollectiveWork(output), output.view(-1), label, None, [reduce_input])


def issue_reduce_scatter(
    grads: list[torch.Tensor], padded_numels: list[int], spec: ReduceSpec, group: ShardGroup, comm: CommContext, label: str,
    custom: Any = None,
) -> PendingReduceScatter:
    """Lay unsharded gradients into a ``[world, group_numel]`` buffer (cast, pre-divided) and reduce-scatter (sum) it.

    ``custom``: an FSDP2 ``ReduceScatter`` (``set_custom_reduce_scatter``) that allocates the
    buffers and runs the collective.
    """
    total = sum(padded_numels)
    world_size, handle = group.shard_size, comm.handle
    stream = comm.reduce_scatter_stream
    gradients_ready = handle.record_event(handle.current_stream(), "gradients")
    handle.wait_event(stream, gradients_ready)
    with handle.on_stream(stream, "reduce_scatter_copy_in"):
        reduce_input = _allocate(custom, (world_size, total), spec.reduce_input_dtype, comm.device)
        ops.reduce_scatter_copy_in(grads, padded_numels, reduce_input, spec.pre_divide)
        own_row = None if spec.wire_dtype is None else _own_chunks_in_float32(grads, padded_numels, group.shard_rank, spec.pre_divide)
        for grad in grads:
            # The compute stream frees these grads once we return; the copy-in may still read them.
            handle.keep_alive(grad, stream)
    record(CollectiveRecord("reduce_scatter", label, total * world_size, spec.reduce_input_dtype, "backward"))
    if spec.wire_dtype is not None:  # a custom reduce-scatter is refused with it (set_custom_reduce_scatter)
        return _issue_wire_reduction(reduce_input, own_row, group, comm, label)
    with handle.on_stream(stream, "reduce_scatter"):
        work, output = None, reduce_input.view(-1)
        if world_size > 1 or custom is not None:
            output = _allocate(custom, (total,), spec.reduce_dtype, comm.device)
            try:
                if custom is not None:
                    work = custom(output, reduce_input.view(-1), group=group.shard_group, op=dist.ReduceOp.SUM, async_op=True)
                else:
                    work = _reduce_scatter_single(output, reduce_input.view(-1), group=group.shard_group, async_op=True)
            except Exception as error:  # noqa: BLE001
                _raise_collective_error("reduce-scatter", label, error)
        event = handle.record_event(stream, "reduce_scatter")
    return PendingReduceScatter(work, output, label, event, keep_alive=[reduce_input])


def reduce_on_one_rank(grad: torch.Tensor, spec: ReduceSpec) -> torch.Tensor:
    """The sharded gradient that a reduce-scatter over one rank makes of ``grad`` (its whole
    gradient in the dim-0 view), without the flat buffer: see [Note: a reduction over a shard group
    of one rank]. The arithmetic of ``issue_reduce_scatter``'s copy-in and copy-out, in their order:
    cast to the reduce dtype, pre-divide, post-divide, cast to the gradient's dtype."""
    value = grad if grad.dtype == spec.reduce_dtype else grad.to(spec.reduce_dtype)
    if spec.pre_divide != 1.0:
        value = value / spec.pre_divide
    if spec.post_divide != 1.0:
        value = value / spec.post_divide
    return value if value.dtype == spec.grad_dtype else value.to(spec.grad_dtype)


def record_reduction_on_one_rank(padded_numels: Callable[[], list[int]], spec: ReduceSpec, label: str) -> None:
    """The log entry ``issue_reduce_scatter`` writes, for a reduction over one rank that issues none:
    ``record_collectives()`` lists every group's reduction at any world size. ``padded_numels`` is
    called only while a log is open."""
    if _active_recorders:
        record(CollectiveRecord("reduce_scatter", label, sum(padded_numels()), spec.reduce_input_dtype, "backward"))


# [Note: the gradient wire's own chunk]
# CommPolicy(reduce_wire_dtype=...) sends each rank's chunks of the gradient by all-to-all in the
# wire dtype and sums what arrives in float32. Of the world chunks a rank sums, one is its own: it
# never crosses the wire, so it is summed as computed (float32), not rounded to the wire dtype.
# The result is the float32 sum, in rank order, of the other ranks' wire-rounded chunks and this
# rank's unrounded one. That is one rounding fewer than "round every contribution": measured max
# error against a float64 mean, 0.44x of a bf16 reduce-scatter's at world 2 (0.56x when the own
# chunk was rounded too) and 0.30x at world 4 (test_comm_policy). The eager copy-out takes the own
# chunk as ``sum_rows_copy_out``'s ``own_row``; the traced reduction (compile/ops.py) selects it
# with the rank read at run time, so the graph stays the same on every rank.


def _own_chunks_in_float32(grads: list[torch.Tensor], padded_numels: list[int], rank: int, pre_divide: float) -> torch.Tensor:
    """This rank's chunk of each gradient, laid out as one row of the wire's copy-in, in float32."""
    chunks = [grad.reshape(-1)[rank * padded : (rank + 1) * padded] for grad, padded in zip(grads, padded_numels)]
    own_row = torch.empty((1, sum(padded_numels)), dtype=torch.float32, device=grads[0].device)
    ops.reduce_scatter_copy_in(chunks, padded_numels, own_row, pre_divide)
    return own_row.view(-1)


def _issue_wire_reduction(
    reduce_input: torch.Tensor, own_row: torch.Tensor, group: ShardGroup, comm: CommContext, label: str
) -> PendingReduceScatter:
    """CommPolicy's gradient wire: an all-to-all hands each rank every rank's chunk of its shard, in
    the wire dtype, as a ``[world, total]`` tensor; the copy-out sums its rows in float32, this
    rank's own chunk ``own_row`` in place of its wire copy (see [Note: the gradient wire's own chunk])."""
    handle, stream = comm.handle, comm.reduce_scatter_stream
    with handle.on_stream(stream, "reduce_scatter"):
        work, received = None, reduce_input
        if group.shard_size > 1:
            received = torch.empty_like(reduce_input)
            try:
                work = dist.all_to_all_single(received.view(-1), reduce_input.view(-1), group=group.shard_group, async_op=True)
            except Exception as error:  # noqa: BLE001
                _raise_collective_error("all-to-all (gradient wire)", label, error)
        event = handle.record_event(stream, "reduce_scatter")
    return PendingReduceScatter(
        work, received, label, event, keep_alive=[reduce_input], own_row=own_row, own_rank=group.shard_rank
    )


@dataclass
class PendingQuantizedAllGather:
    """CommPolicy's block-quantized all-gather in flight: the data and the scales, two collectives."""

    data: PendingAllGather
    scales: PendingAllGather

    @property
    def overlapped(self) -> bool:
        return self.data.overlapped

    def wait(self, comm: CommContext) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data.wait(comm), self.scales.wait(comm)


def issue_quantized_all_gather(
    shards: list[torch.Tensor], padded_numels: list[int], wire_dtype: torch.dtype, block_size: int, group: ShardGroup,
    comm: CommContext, label: str, reason: str,
) -> PendingQuantizedAllGather:
    """Quantize this rank's shards per block into its rows of a data and a scale buffer (one fused
    copy-in) and all-gather both; see [Note: quantized all-gather layout] in kernels/quantized_reference.py."""
    slots = sum(quantized_reference.quantized_slot_numels(padded_numels, block_size))
    # gloo has no float8 dtype: e4m3 travels as its bytes.
    buffer_dtype = quantized_reference.E4M3_BYTES if wire_dtype == torch.float8_e4m3fn else wire_dtype
    streams = comm.all_gather_streams(reason)
    with comm.handle.on_stream(streams[0], "all_gather_copy_in"):
        data = torch.empty((group.shard_size, slots), dtype=buffer_dtype, device=comm.device)
        scales = torch.empty((group.shard_size, slots // block_size), dtype=torch.float32, device=comm.device)
        quantized.quantized_all_gather_copy_in(shards, padded_numels, data[group.shard_rank], scales[group.shard_rank], block_size)
    comm.handle.wait_stream(streams[1], streams[0])
    return PendingQuantizedAllGather(
        _gather_rows(data, wire_dtype, group, comm, streams, label, reason),
        _gather_rows(scales, torch.float32, group, comm, streams, label, reason),
    )


def gather_full(local: torch.Tensor, layout: ShardLayout, group: ShardGroup, device: torch.device, label: str, reason: str) -> torch.Tensor:
    """The full tensor from every rank's shard of it (``local``, laid out by ``layout``), in
    ``local``'s dtype: a plain blocking all-gather over the shard group for state dicts and
    ``unshard_params``, outside the runtime's all-gather (so full precision, not ``param_dtype``)."""
    local = local.detach().to(device)  # CPU-offloaded shards travel over the device's backend
    if group.shard_size == 1:
        return local.clone()
    send = layout.padded_dim0_shard(local)
    gathered = torch.empty((layout.chunk * group.shard_size, *send.shape[1:]), dtype=local.dtype, device=local.device)
    record(CollectiveRecord("all_gather", label, send.numel(), send.dtype, reason))
    all_gather_single(gathered, send, group=group.shard_group)
    full = layout.full_from_gathered(gathered)
    # A copy when the result is a view of padding or of the dim-0 layout: it outlives the buffer.
    return full if full.is_contiguous() and full.numel() == gathered.numel() else full.clone(memory_format=torch.contiguous_format)


def all_reduce_replicas(tensor: torch.Tensor, group: dist.ProcessGroup, label: str) -> None:
    """HSDP: sum the reduce-scattered shard across replicas (blocking)."""
    record(CollectiveRecord("all_reduce", label, tensor.numel(), tensor.dtype, "backward"))
    try:
        dist.all_reduce(tensor, group=group)
    except Exception as error:  # noqa: BLE001
        _raise_collective_error("all-reduce", label, error)
