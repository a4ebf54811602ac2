"""The custom ops compiled graphs hold: one vocabulary that the graph passes, the backends and the
run-time side of block frames all name (docs/design.md section 5.1).

``fsdp_compile::all_gather_shard`` is what a managed parameter's read traces to ([Note: the traced
all-gather is one op]); ``shard_rank`` reads the rank when a graph runs; the three frame ops
(``frame_all_gather``, ``deliver_reduced_gradient``, ``deliver_reduce_scatter_late``) cross block
frames at run time. What those three do when a graph runs lives in ``frames.py``, which serves them
(``serve_frame_ops``) as it is imported: this module imports nothing of the project but the kernels,
so the graph passes import it without the runtime.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp_compile.kernels import quantized_reference

__all__ = [
    "TRACED_OP_DECOMPOSITIONS", "gather_shard", "pad_rows", "frame_all_gather", "deliver_reduced_gradient", "deliver_reduce_scatter_late",
    "serve_frame_ops",
]

_functional = torch.ops._c10d_functional


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with ``rows`` zero rows appended on dim 0 (an op even when ``rows`` is 0)."""
    # constant_pad_nd, the op F.pad lowers to: Dynamo traces F.pad's Python wrapper at every read.
    return torch.constant_pad_nd(tensor, [0, 0] * (tensor.dim() - 1) + [0, rows])


def gather_shard(
    padded_shard: torch.Tensor, param_dtype: torch.dtype, shard_size: int, shard_group_name: str,
    quantize: tuple[torch.dtype, int] | None = None,
) -> torch.Tensor:
    if quantize is not None:
        return _gather_quantized(padded_shard, param_dtype, shard_size, shard_group_name, *quantize)
    if shard_size == 1:  # [Note: no collective over one rank]
        return padded_shard.to(param_dtype, copy=True)
    gathered = _functional.all_gather_into_tensor(padded_shard.to(param_dtype), shard_size, shard_group_name)
    return _functional.wait_tensor(gathered)


# [Note: no collective over one rank]
# At world size 1 (or a shard mesh dimension of size 1) an all-gather returns its input and a
# reduce-scatter its input summed over one rank: the traced unshard keeps the arithmetic (the casts,
# the quantize round-trip, the divide factors) and leaves the collectives out, as the eager runtime
# skips them (collectives.py) and FSDP2 does. A step at world size 1 then issues no collective
# compiled either (it issued one per parameter read and gradient: 80 a step on the 16-layer
# benchmark model on an H200, where the host time of each is what a small step is made of).


def _all_gather_rows(tensor: torch.Tensor, shard_size: int, shard_group_name: str) -> torch.Tensor:
    if shard_size == 1:
        return tensor
    return _functional.wait_tensor(_functional.all_gather_into_tensor(tensor, shard_size, shard_group_name))


def _gather_quantized(
    padded_shard: torch.Tensor, param_dtype: torch.dtype, shard_size: int, shard_group_name: str,
    wire_dtype: torch.dtype, block_size: int,
) -> torch.Tensor:
    """CommPolicy's quantized all-gather as graph nodes: the eager copy-in / copy-out's arithmetic
    (kernels/quantized_reference.py), with the shard zero-padded to whole blocks (its slot)."""
    flat = padded_shard.reshape(-1)
    slot = quantized_reference.quantized_slot_numels([flat.numel()], block_size)[0]
    data, scales = quantized_reference.quantize_blocks(F.pad(flat, [0, slot - flat.numel()]), block_size, wire_dtype)
    # gloo has no float8 dtype: e4m3 travels as its bytes.
    sent = data.view(quantized_reference.E4M3_BYTES) if wire_dtype == torch.float8_e4m3fn else data
    gathered = _all_gather_rows(sent, shard_size, shard_group_name)
    gathered_scales = _all_gather_rows(scales, shard_size, shard_group_name)
    values = quantized_reference.dequantize_blocks(gathered.view(wire_dtype), gathered_scales, block_size, param_dtype)
    rows = values.view(shard_size, slot)[:, : flat.numel()]
    return rows.reshape(shard_size * padded_shard.shape[0], *padded_shard.shape[1:])


@torch.library.custom_op("fsdp_compile::shard_rank", mutates_args=())
def _shard_rank(like: torch.Tensor, shard_group_name: str) -> torch.Tensor:
    """This process's rank in the group, as a 0-d int64 tensor on ``like``'s device.

    An op, read when the graph runs, rather than a constant traced into it: the graph (and the
    caches keyed on it) stays the same on every rank.
    """
    rank = dist.get_rank(dist.distributed_c10d._resolve_process_group(shard_group_name))
    return torch.full((), rank, dtype=torch.int64, device=like.device)


@_shard_rank.register_fake
def _shard_rank_shape(like: torch.Tensor, shard_group_name: str) -> torch.Tensor:
    return like.new_empty((), dtype=torch.int64)


def _reduce_over_wire(grad: torch.Tensor, wire_dtype: torch.dtype, shard_size: int, shard_group_name: str) -> torch.Tensor:
    """CommPolicy's gradient wire as graph nodes: all-to-all of the chunks in ``wire_dtype``, then the
    float32 sum of the received rows in rank order, this rank's own chunk unrounded (the eager
    ``sum_rows_copy_out``'s arithmetic; see [Note: the gradient wire's own chunk] in collectives.py)."""
    sent = grad.to(wire_dtype).contiguous()
    splits = [grad.shape[0] // shard_size] * shard_size
    received = _functional.wait_tensor(_functional.all_to_all_single(sent, splits, splits, shard_group_name))
    rows = received.view(shard_size, -1)
    rank = torch.ops.fsdp_compile.shard_rank(grad, shard_group_name)
    own_row = grad.reshape(shard_size, -1).index_select(0, rank.view(1)).view(-1).to(torch.float32)
    return quantized_reference.sum_rows(rows, own_row, rank).view(grad.shape[0] // shard_size, *grad.shape[1:])


# [Note: the traced all-gather is one op]
# Each parameter read traces one call of ``fsdp_compile::all_gather_shard``, a torch.library op
# whose autograd formula is the eager reduction, rather than a Python autograd.Function. Dynamo
# speculates an autograd.Function's forward and backward at every call, for every parameter of
# every block (measured: 8.3 s of Dynamo tracing for the 8-layer benchmark model, 5.1 s with the
# op), and AOTAutograd's cache refuses graphs holding one, so every restarted process traced and
# partitioned the whole model again. Dynamo records the op as one node (its fake implementation
# gives the shape); AOTAutograd traces its autograd formula, and TRACED_OP_DECOMPOSITIONS turns
# its forward into the functional all-gather (fsdp_inductor adds it to Inductor's decomposition
# table, fsdp_aot_eager hands it to AOTAutograd), so the graphs the passes see hold the same
# annotated collectives as before. Another backend keeps the op whole: it runs the same all-gather
# as one opaque call, which the passes never see.
_ALL_GATHER_SHARD_SCHEMA = (
    "(Tensor padded_shard, Tensor? accumulated, Tensor? deferred, Tensor? deferred_sink, ScalarType param_dtype, "
    "ScalarType reduce_dtype, ScalarType grad_dtype, float pre_divide, float post_divide, int shard_size, "
    "ScalarType? wire_dtype, ScalarType? quantize_dtype, int quantize_block_size, str shard_group_name, "
    "str? replicate_group_name, Tensor? late_sink=None) -> Tensor"
)


def _all_gather_shard_forward(
    padded_shard: torch.Tensor, accumulated: torch.Tensor | None, deferred: torch.Tensor | None,
    deferred_sink: torch.Tensor | None, param_dtype: torch.dtype, reduce_dtype: torch.dtype, grad_dtype: torch.dtype,
    pre_divide: float, post_divide: float, shard_size: int, wire_dtype: torch.dtype | None,
    quantize_dtype: torch.dtype | None, quantize_block_size: int, shard_group_name: str, replicate_group_name: str | None,
    late_sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Padded local shard (orig dtype, dim-0 view) -> gathered [world * chunk, ...] in param_dtype;
    ``late_sink``: the parameter's ``gradient_handover_sink``, given where its reduced gradient goes to
    the runtime rather than out of the graph ([Note: late reduce-scatter wait across block frames] in frames.py)."""
    quantize = None if quantize_dtype is None else (quantize_dtype, quantize_block_size)
    return gather_shard(padded_shard, param_dtype, shard_size, shard_group_name, quantize)


_all_gather_shard = torch.library.custom_op(
    "fsdp_compile::all_gather_shard", _all_gather_shard_forward, mutates_args=(), schema=_ALL_GATHER_SHARD_SCHEMA
)


@_all_gather_shard.register_fake
def _all_gather_shard_shape(padded_shard: torch.Tensor, accumulated: object, deferred: object, deferred_sink: object,
                            param_dtype: torch.dtype, reduce_dtype: object, grad_dtype: object, pre_divide: object,
                            post_divide: object, shard_size: int, *rest: object) -> torch.Tensor:
    return padded_shard.new_empty((shard_size * padded_shard.shape[0], *padded_shard.shape[1:]), dtype=param_dtype)


def _save_reduction(ctx, inputs: tuple, output: torch.Tensor) -> None:
    (_, accumulated, deferred, deferred_sink, _, ctx.reduce_dtype, ctx.grad_dtype, ctx.pre_divide, ctx.post_divide,
     ctx.shard_size, ctx.wire_dtype, _, _, ctx.shard_group_name, ctx.replicate_group_name, late_sink) = inputs
    ctx.has_accumulated, ctx.has_deferred = accumulated is not None, deferred is not None
    ctx.defers_all_reduce = deferred_sink is not None
    ctx.delivers_late = late_sink is not None
    ctx.save_for_backward(*(t for t in (accumulated, deferred, late_sink) if t is not None))


def _reduce_gathered_grad(ctx, grad: torch.Tensor) -> tuple:
    """The eager reduction of ``ReduceSpec``, field by field, of the gradient plus ``accumulated``
    (the no-sync steps' sum, in the gathered layout's rows). With HSDP it adds ``deferred`` (the
    reduce-scattered sum of steps that skipped the all-reduce) before the all-reduce; given
    ``deferred_sink`` (``set_requires_all_reduce(False)``), it skips the all-reduce and returns the
    sum as that leaf's gradient instead of the shard's (see [Note: deferred all-reduce] in param.py).
    """
    saved = list(ctx.saved_tensors)
    grad = grad.to(ctx.reduce_dtype)
    if ctx.has_accumulated:
        accumulated = saved.pop(0)
        # Eagerly the accumulated sum absorbs this step's gradient; the same addition, padded.
        grad = grad + pad_rows(accumulated, grad.shape[0] - accumulated.shape[0])
    if ctx.pre_divide != 1.0:
        grad = grad / ctx.pre_divide
    if ctx.wire_dtype is not None:
        reduced = _reduce_over_wire(grad, ctx.wire_dtype, ctx.shard_size, ctx.shard_group_name)
    elif ctx.shard_size == 1:  # [Note: no collective over one rank]
        reduced = grad
    else:
        reduced = _functional.wait_tensor(
            _functional.reduce_scatter_tensor(grad.contiguous(), "sum", ctx.shard_size, ctx.shard_group_name)
        )
    no_grads = (None,) * 11
    if ctx.replicate_group_name is not None:
        if ctx.has_deferred:
            reduced = reduced + saved.pop(0)
        if ctx.defers_all_reduce:
            return None, None, None, reduced, *no_grads, None
        reduced = _functional.wait_tensor(_functional.all_reduce(reduced, "sum", ctx.replicate_group_name))
    if ctx.post_divide != 1.0:
        reduced = reduced / ctx.post_divide
    if ctx.delivers_late:
        late_sink = saved.pop(0)
        return None, None, None, None, *no_grads, torch.ops.fsdp_compile.deliver_reduced_gradient(reduced.to(ctx.grad_dtype), late_sink)
    return reduced.to(ctx.grad_dtype), None, None, None, *no_grads, None


_all_gather_shard.register_autograd(_reduce_gathered_grad, setup_context=_save_reduction)

# What fsdp_inductor and fsdp_aot_eager add to AOTAutograd's decompositions.
TRACED_OP_DECOMPOSITIONS = {torch.ops.fsdp_compile.all_gather_shard.default: _all_gather_shard_forward}


class FrameOpsRuntime(NamedTuple):
    """What the frame ops do when a graph runs (``frames.py``): the all-gather handed across block
    frames, and the reduced gradients handed to the runtime now or late."""

    gather_in_frame: Callable[..., torch.Tensor]
    deliver_gradient_now: Callable[[torch.Tensor, torch.Tensor], None]
    deliver_gradients_late: Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor]], None]


# Set once, by frames.py as it is imported (the package imports it before any graph can run).
_frame_ops_runtime: FrameOpsRuntime | None = None


def serve_frame_ops(runtime: FrameOpsRuntime) -> None:
    global _frame_ops_runtime
    _frame_ops_runtime = runtime


def _served() -> FrameOpsRuntime:
    if _frame_ops_runtime is None:
        raise RuntimeError("fsdp_compile: a block frame's op ran before fsdp_compile.compile.frames was imported (import fsdp_compile first)")
    return _frame_ops_runtime


@torch.library.custom_op(
    "fsdp_compile::frame_all_gather", mutates_args=(),
    schema=(
        "(Tensor[] shards, int[] padded_numels, ScalarType param_dtype, int shard_size, str shard_group_name, bool backward, "
        "Device device) -> Tensor"
    ),
)
def frame_all_gather(
    shards: list[torch.Tensor], padded_numels: list[int], param_dtype: torch.dtype, shard_size: int, shard_group_name: str,
    backward: bool, device: torch.device,
) -> torch.Tensor:
    """In a block frame's forward (``backward`` False) or backward graph, in place of its group's
    all-gather (copy-in and all-gather, left in flight for the graph's wait): the all-gather the block
    that ran before it issued for it (in forward the block before it, in backward the block after it),
    else one issued now; either way it then issues that of the block that runs next. See [Note:
    prefetch across block frames] in frames.py and [Note: backward prefetch across block frames] in frames.py.
    ``device``: where the gathered tensor lives; CPU-offloaded ``shards`` are host tensors, copied
    there by the runtime ([Note: offloaded shards under whole-model compile] in param_reads.py)."""
    return _served().gather_in_frame(shards, padded_numels, param_dtype, shard_size, shard_group_name, backward, device)


@frame_all_gather.register_fake
def _frame_all_gather_shape(
    shards: list[torch.Tensor], padded_numels: list[int], param_dtype: torch.dtype, shard_size: int, shard_group_name: str,
    backward: bool, device: torch.device,
) -> torch.Tensor:
    return shards[0].new_empty((shard_size * sum(padded_numels),), dtype=param_dtype, device=device)


@torch.library.custom_op("fsdp_compile::deliver_reduced_gradient", mutates_args=())
def deliver_reduced_gradient(reduced: torch.Tensor, late_sink: torch.Tensor) -> torch.Tensor:
    """In a block frame's backward graph: write one parameter's reduced gradient (its padded shard in
    the dim-0 view, divided and cast) into its sharded ``.grad``, as autograd would, and return the
    sink's gradient (zeros). The graph's own form; the post-grad pass makes a bucket's deliveries
    late (``deliver_reduce_scatter_late``). See [Note: late reduce-scatter wait across block frames]
    in frames.py."""
    _served().deliver_gradient_now(reduced, late_sink)
    return torch.zeros_like(late_sink)


@deliver_reduced_gradient.register_fake
def _deliver_reduced_gradient_shape(reduced: torch.Tensor, late_sink: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(late_sink)


@torch.library.custom_op("fsdp_compile::deliver_reduce_scatter_late", mutates_args=())
def deliver_reduce_scatter_late(in_flight: torch.Tensor, reduce_input: torch.Tensor, late_sinks: list[torch.Tensor]) -> torch.Tensor:
    """At the end of a block frame's backward graph: hand a bucket's reduce-scatter, still in flight,
    to the runtime, which waits on it and writes the sinks' parameters' gradients once the next
    block's backward hands over its own (or the backward ends). ``reduce_input`` is kept alive until
    then. Returns the sinks' gradient (zeros). See [Note: late reduce-scatter wait across block
    frames] in frames.py."""
    _served().deliver_gradients_late(in_flight, reduce_input, late_sinks)
    return torch.zeros_like(late_sinks[0])


@deliver_reduce_scatter_late.register_fake
def _deliver_reduce_scatter_late_shape(in_flight: torch.Tensor, reduce_input: torch.Tensor, late_sinks: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty_like(late_sinks[0])
