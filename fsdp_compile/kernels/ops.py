"""The four copy operations as ``torch.library`` custom ops (``torch.ops.fsdp_compile.*``).

Being custom ops lets Dynamo and Inductor hold them in graphs as single nodes. The
default (every-device) implementation is the plain-torch reference in ``reference.py``;
``triton_impl.py`` registers the CUDA kernels. Arguments are checked here, once, for
every implementation, so a bad call fails with a message instead of writing out of bounds.
"""
from __future__ import annotations

import torch

from fsdp_compile.kernels import reference

__all__ = [
    "all_gather_copy_in",
    "all_gather_copy_in_functional",
    "all_gather_copy_out",
    "all_gather_copy_out_functional",
    "reduce_scatter_copy_in",
    "reduce_scatter_copy_out",
    "check_all_gather_copy_in",
    "check_all_gather_copy_out",
    "check_reduce_scatter_copy_in",
    "check_reduce_scatter_copy_out",
]


def _fail(op: str, message: str) -> None:
    raise ValueError(f"fsdp_compile.kernels.{op}: {message}")


def _check_float(op: str, name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_floating_point():
        _fail(op, f"{name} has dtype {tensor.dtype}; only floating-point tensors are supported")


def _check_contiguous(op: str, name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        _fail(op, f"{name} must be contiguous (got strides {tuple(tensor.stride())}); call .contiguous() first")


def _check_padded_numels(op: str, count: int, what: str, padded_numels: list[int]) -> None:
    if len(padded_numels) != count:
        _fail(op, f"got {count} {what} but {len(padded_numels)} padded_numels; pass one padded size per parameter")
    for index, padded in enumerate(padded_numels):
        if padded < 0:
            _fail(op, f"padded_numels[{index}] = {padded} is negative")


def _check_device(op: str, reference_tensor: torch.Tensor, tensors: list[torch.Tensor], what: str) -> None:
    for index, tensor in enumerate(tensors):
        if tensor.device != reference_tensor.device:
            _fail(op, f"{what}[{index}] is on {tensor.device} but the buffer is on {reference_tensor.device}")


def check_all_gather_copy_in(shards: list[torch.Tensor], padded_numels: list[int], out: torch.Tensor) -> None:
    op = "all_gather_copy_in"
    _check_padded_numels(op, len(shards), "shards", padded_numels)
    _check_float(op, "out", out)
    if out.dim() != 1 or not out.is_contiguous():
        _fail(op, f"out must be a contiguous 1-D buffer (this rank's row of the all-gather output), got shape {tuple(out.shape)}")
    if out.numel() != sum(padded_numels):
        _fail(op, f"out has {out.numel()} elements but the padded shards need {sum(padded_numels)}")
    _check_device(op, out, shards, "shards")
    for index, (shard, padded) in enumerate(zip(shards, padded_numels)):
        _check_float(op, f"shards[{index}]", shard)
        _check_contiguous(op, f"shards[{index}]", shard)
        if shard.numel() > padded:
            _fail(op, f"shards[{index}] has {shard.numel()} elements, more than its padded size {padded}")


def check_all_gather_copy_out(gathered: torch.Tensor, padded_numels: list[int], outs: list[torch.Tensor]) -> None:
    op = "all_gather_copy_out"
    _check_padded_numels(op, len(outs), "outs", padded_numels)
    _check_float(op, "gathered", gathered)
    if gathered.dim() != 2 or not gathered.is_contiguous():
        _fail(op, f"gathered must be a contiguous [world, group_numel] tensor, got shape {tuple(gathered.shape)}")
    if gathered.shape[1] != sum(padded_numels):
        _fail(op, f"gathered has {gathered.shape[1]} columns but padded_numels add up to {sum(padded_numels)}")
    _check_device(op, gathered, outs, "outs")
    world = gathered.shape[0]
    for index, (out, padded) in enumerate(zip(outs, padded_numels)):
        _check_float(op, f"outs[{index}]", out)
        _check_contiguous(op, f"outs[{index}]", out)
        if out.numel() > world * padded:
            _fail(op, f"outs[{index}] has {out.numel()} elements but {world} ranks x {padded} padded hold only {world * padded}")


def check_reduce_scatter_copy_in(
    grads: list[torch.Tensor], padded_numels: list[int], out: torch.Tensor, pre_divide: float
) -> None:
    op = "reduce_scatter_copy_in"
    _check_padded_numels(op, len(grads), "grads", padded_numels)
    _check_float(op, "out", out)
    if out.dim() != 2 or not out.is_contiguous():
        _fail(op, f"out must be a contiguous [world, group_numel] buffer, got shape {tuple(out.shape)}")
    if out.shape[1] != sum(padded_numels):
        _fail(op, f"out has {out.shape[1]} columns but padded_numels add up to {sum(padded_numels)}")
    if pre_divide == 0:
        _fail(op, "pre_divide must be non-zero")
    _check_device(op, out, grads, "grads")
    world = out.shape[0]
    for index, (grad, padded) in enumerate(zip(grads, padded_numels)):
        _check_float(op, f"grads[{index}]", grad)
        _check_contiguous(op, f"grads[{index}]", grad)
        if grad.numel() > world * padded:
            _fail(op, f"grads[{index}] has {grad.numel()} elements but {world} ranks x {padded} padded hold only {world * padded}")


def check_reduce_scatter_copy_out(
    reduced: torch.Tensor, padded_numels: list[int], outs: list[torch.Tensor], post_divide: float, accumulate: bool
) -> None:
    op = "reduce_scatter_copy_out"
    _check_padded_numels(op, len(outs), "outs", padded_numels)
    _check_float(op, "reduced", reduced)
    if reduced.dim() != 1 or not reduced.is_contiguous():
        _fail(op, f"reduced must be a contiguous 1-D shard, got shape {tuple(reduced.shape)}")
    if reduced.numel() != sum(padded_numels):
        _fail(op, f"reduced has {reduced.numel()} elements but padded_numels add up to {sum(padded_numels)}")
    if post_divide == 0:
        _fail(op, "post_divide must be non-zero")
    _check_device(op, reduced, outs, "outs")
    for index, (out, padded) in enumerate(zip(outs, padded_numels)):
        _check_float(op, f"outs[{index}]", out)
        _check_contiguous(op, f"outs[{index}]", out)
        if out.numel() > padded:
            _fail(op, f"outs[{index}] has {out.numel()} elements, more than its padded shard size {padded}")


@torch.library.custom_op("fsdp_compile::all_gather_copy_in", mutates_args=("out",))
def all_gather_copy_in(shards: list[torch.Tensor], padded_numels: list[int], out: torch.Tensor) -> None:
    """Cast N (unpadded) shards into this rank's flat slot ``out`` of the all-gather output, zero-padding each."""
    check_all_gather_copy_in(shards, padded_numels, out)
    reference.all_gather_copy_in(shards, padded_numels, out)


@torch.library.custom_op("fsdp_compile::all_gather_copy_out", mutates_args=("outs",))
def all_gather_copy_out(gathered: torch.Tensor, padded_numels: list[int], outs: list[torch.Tensor]) -> None:
    """Scatter the ``[world, group_numel]`` all-gather output into N unsharded parameters (unpadded, cast)."""
    check_all_gather_copy_out(gathered, padded_numels, outs)
    reference.all_gather_copy_out(gathered, padded_numels, outs)


def _split_shapes(sizes: list[int], ndims: list[int]) -> list[list[int]]:
    shapes, start = [], 0
    for ndim in ndims:
        shapes.append(sizes[start : start + ndim])
        start += ndim
    return shapes


def _new_unsharded(gathered: torch.Tensor, sizes: list[int], ndims: list[int]) -> list[torch.Tensor]:
    return [gathered.new_empty(shape) for shape in _split_shapes(sizes, ndims)]


def _new_bucket(shards: list[torch.Tensor], padded_numels: list[int], dtype: torch.dtype) -> torch.Tensor:
    return shards[0].new_empty(sum(padded_numels), dtype=dtype)


# [Note: one copy-in and one copy-out per bucket in compiled graphs]
# The bucket pass (passes/bucket.py) writes an all-gather bucket's padded, cast shards into one
# flat buffer and gives each parameter its unsharded tensor from the gathered ``[world, total]``
# rows. Left to Inductor, that is a generated node per parameter for the copy-in and a generated
# kernel per parameter for the copy-out (slices pinned to a contiguous layout), about thirty per
# block between forward and backward's re-gather, generated again for every block though identical
# (most of a deep model's compile time outside the blocks' bodies). These two ops are one node
# each per bucket (``all_gather_copy_in`` / ``all_gather_copy_out``: the Triton kernels on CUDA),
# extern calls for Inductor. The post-grad graphs they go into hold no mutation, hence they return
# fresh tensors rather than writing into ``out`` / ``outs``. Shapes travel flat (``sizes`` holds
# each parameter's dims in turn, ``ndims`` how many each has): a schema takes no nested lists.
@torch.library.custom_op(
    "fsdp_compile::all_gather_copy_in_functional", mutates_args=(),
    schema="(Tensor[] shards, int[] padded_numels, ScalarType dtype) -> Tensor",
)
def all_gather_copy_in_functional(shards: list[torch.Tensor], padded_numels: list[int], dtype: torch.dtype) -> torch.Tensor:
    """``all_gather_copy_in`` into a new flat buffer of ``dtype`` (for compiled graphs; see the note above)."""
    out = _new_bucket(shards, padded_numels, dtype)
    torch.ops.fsdp_compile.all_gather_copy_in(shards, padded_numels, out)
    return out


@all_gather_copy_in_functional.register_fake
def _all_gather_copy_in_functional_shape(shards: list[torch.Tensor], padded_numels: list[int], dtype: torch.dtype) -> torch.Tensor:
    return _new_bucket(shards, padded_numels, dtype)


@torch.library.custom_op(
    "fsdp_compile::all_gather_copy_out_functional", mutates_args=(),
    schema="(Tensor gathered, int[] padded_numels, int[] sizes, int[] ndims) -> Tensor[]",
)
def all_gather_copy_out_functional(
    gathered: torch.Tensor, padded_numels: list[int], sizes: list[int], ndims: list[int]
) -> list[torch.Tensor]:
    """``all_gather_copy_out`` into new tensors of the given shapes (for compiled graphs; see
    [Note: one copy-in and one copy-out per bucket in compiled graphs])."""
    outs = _new_unsharded(gathered, sizes, ndims)
    torch.ops.fsdp_compile.all_gather_copy_out(gathered, padded_numels, outs)
    return outs


@all_gather_copy_out_functional.register_fake
def _all_gather_copy_out_functional_shapes(
    gathered: torch.Tensor, padded_numels: list[int], sizes: list[int], ndims: list[int]
) -> list[torch.Tensor]:
    return _new_unsharded(gathered, sizes, ndims)


@torch.library.custom_op("fsdp_compile::reduce_scatter_copy_in", mutates_args=("out",))
def reduce_scatter_copy_in(
    grads: list[torch.Tensor], padded_numels: list[int], out: torch.Tensor, pre_divide: float
) -> None:
    """Lay N unsharded gradients into the ``[world, group_numel]`` reduce-scatter input, cast and pre-divided."""
    check_reduce_scatter_copy_in(grads, padded_numels, out, pre_divide)
    reference.reduce_scatter_copy_in(grads, padded_numels, out, pre_divide)


@torch.library.custom_op("fsdp_compile::reduce_scatter_copy_out", mutates_args=("outs",))
def reduce_scatter_copy_out(
    reduced: torch.Tensor, padded_numels: list[int], outs: list[torch.Tensor], post_divide: float, accumulate: bool
) -> None:
    """Write (or accumulate) the reduced shard into N sharded gradients, post-divided and cast."""
    check_reduce_scatter_copy_out(reduced, padded_numels, outs, post_divide, accumulate)
    reference.reduce_scatter_copy_out(reduced, padded_numels, outs, post_divide, accumulate)
