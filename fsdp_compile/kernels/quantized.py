"""The low-precision collectives' copy operations as ``torch.library`` custom ops (``torch.ops.fsdp_compile.*``).

* ``quantized_all_gather_copy_in``: shards -> this rank's int8 / float8_e4m3fn row and its
  per-block float32 scales (the quantize fused into the copy-in).
* ``quantized_all_gather_copy_out``: the gathered ``[world, total]`` data and scales ->
  the unsharded parameters, dequantized and cast (the dequantize fused into the copy-out).
* ``sum_rows_copy_out``: the ``[world, total]`` chunks an all-to-all delivered (bf16 on the
  wire, say) -> the sharded gradients, summed in float32 in rank order and post-divided.

Same pattern as ``ops.py``: arguments are checked here for every implementation; the default
implementation is the plain-torch ``quantized_reference.py``; ``quantized_triton.py`` registers
the CUDA kernels. Wire buffers may be int8, float8_e4m3fn, or uint8, which the ops read as
float8_e4m3fn bytes, so a backend without fp8 (gloo) can all-gather the buffer as is.

``padded_numels`` means what it means for the other ops (each parameter's per-rank chunk);
the quantized buffers give each chunk a slot of whole blocks, see [Note: quantized all-gather
layout] in ``quantized_reference.py`` and ``quantized_slot_numels``.
"""
from __future__ import annotations

import torch

from fsdp_compile.kernels import quantized_reference
from fsdp_compile.kernels.ops import _check_contiguous, _check_device, _check_float, _check_padded_numels, _fail

__all__ = [
    "quantized_all_gather_copy_in",
    "quantized_all_gather_copy_out",
    "sum_rows_copy_out",
    "check_quantized_all_gather_copy_in",
    "check_quantized_all_gather_copy_out",
    "check_sum_rows_copy_out",
]

_WIRE_BUFFER_DTYPES = (torch.int8, torch.float8_e4m3fn, quantized_reference.E4M3_BYTES)


def _slot_total(op: str, padded_numels: list[int], block_size: int) -> int:
    """The quantized buffers' columns: see [Note: quantized all-gather layout]."""
    if block_size <= 0:
        _fail(op, f"block_size must be positive, got {block_size}")
    return sum(quantized_reference.quantized_slot_numels(padded_numels, block_size))


def _size_hint(block_size: int) -> str:
    return (
        f"each parameter's padded numel rounded up to a multiple of block_size {block_size}; size the buffers "
        "with fsdp_compile.kernels.quantized_slot_numels"
    )


def _check_wire(op: str, name: str, tensor: torch.Tensor, dim: int) -> None:
    if tensor.dtype not in _WIRE_BUFFER_DTYPES:
        _fail(op, f"{name} has dtype {tensor.dtype}; use torch.int8, torch.float8_e4m3fn, or torch.uint8 for e4m3fn bytes")
    if tensor.dim() != dim or not tensor.is_contiguous():
        _fail(op, f"{name} must be a contiguous {dim}-D buffer, got shape {tuple(tensor.shape)}")


def _check_scales(op: str, name: str, scales: torch.Tensor, shape: tuple[int, ...], data: torch.Tensor) -> None:
    if scales.dtype != torch.float32 or tuple(scales.shape) != shape or not scales.is_contiguous():
        _fail(
            op,
            f"{name} must be a contiguous float32 tensor of shape {shape} (one scale per block), "
            f"got {scales.dtype} of shape {tuple(scales.shape)}",
        )
    if scales.device != data.device:
        _fail(op, f"{name} is on {scales.device} but the data is on {data.device}")


def check_quantized_all_gather_copy_in(
    shards: list[torch.Tensor], padded_numels: list[int], out_data: torch.Tensor, out_scales: torch.Tensor, block_size: int
) -> None:
    op = "quantized_all_gather_copy_in"
    _check_padded_numels(op, len(shards), "shards", padded_numels)
    total = _slot_total(op, padded_numels, block_size)
    _check_wire(op, "out_data", out_data, 1)
    if out_data.numel() != total:
        _fail(op, f"out_data has {out_data.numel()} elements but the shards' slots need {total} ({_size_hint(block_size)})")
    _check_scales(op, "out_scales", out_scales, (total // block_size,), out_data)
    _check_device(op, out_data, shards, "shards")
    for index, (shard, padded) in enumerate(zip(shards, padded_numels)):
        _check_float(op, f"shards[{index}]", shard)
        _check_contiguous(op, f"shards[{index}]", shard)
        if shard.numel() > padded:
            _fail(op, f"shards[{index}] has {shard.numel()} elements, more than its padded size {padded}")


def check_quantized_all_gather_copy_out(
    gathered_data: torch.Tensor,
    gathered_scales: torch.Tensor,
    padded_numels: list[int],
    outs: list[torch.Tensor],
    block_size: int,
) -> None:
    op = "quantized_all_gather_copy_out"
    _check_padded_numels(op, len(outs), "outs", padded_numels)
    slot_total = _slot_total(op, padded_numels, block_size)
    _check_wire(op, "gathered_data", gathered_data, 2)
    world, total = gathered_data.shape
    if total != slot_total:
        _fail(op, f"gathered_data has {total} columns but the parameters' slots need {slot_total} ({_size_hint(block_size)})")
    _check_scales(op, "gathered_scales", gathered_scales, (world, total // block_size), gathered_data)
    _check_device(op, gathered_data, outs, "outs")
    for index, (out, padded) in enumerate(zip(outs, padded_numels)):
        _check_float(op, f"outs[{index}]", out)
        _check_contiguous(op, f"outs[{index}]", out)
        if out.numel() > world * padded:
            _fail(op, f"outs[{index}] has {out.numel()} elements but {world} ranks x {padded} padded hold only {world * padded}")


def check_sum_rows_copy_out(
    received: torch.Tensor, padded_numels: list[int], outs: list[torch.Tensor], post_divide: float, accumulate: bool,
    own_row: torch.Tensor | None = None, own_rank: int = 0,
) -> None:
    op = "sum_rows_copy_out"
    _check_padded_numels(op, len(outs), "outs", padded_numels)
    _check_float(op, "received", received)
    if received.dim() != 2 or not received.is_contiguous() or received.shape[0] == 0:
        _fail(op, f"received must be a contiguous [world, group_numel] tensor with world >= 1, got shape {tuple(received.shape)}")
    if received.shape[1] != sum(padded_numels):
        _fail(op, f"received has {received.shape[1]} columns but padded_numels add up to {sum(padded_numels)}")
    if post_divide == 0:
        _fail(op, "post_divide must be non-zero")
    _check_device(op, received, outs, "outs")
    if own_row is not None:
        if own_row.dtype != torch.float32 or tuple(own_row.shape) != (received.shape[1],) or not own_row.is_contiguous():
            _fail(
                op,
                f"own_row must be a contiguous float32 row of {received.shape[1]} elements, got {own_row.dtype} "
                f"of shape {tuple(own_row.shape)}",
            )
        if own_row.device != received.device:
            _fail(op, f"own_row is on {own_row.device}, received on {received.device}")
        if not 0 <= own_rank < received.shape[0]:
            _fail(op, f"own_rank {own_rank} is not a row of the {received.shape[0]} received")
    for index, (out, padded) in enumerate(zip(outs, padded_numels)):
        _check_float(op, f"outs[{index}]", out)
        _check_contiguous(op, f"outs[{index}]", out)
        if out.numel() > padded:
            _fail(op, f"outs[{index}] has {out.numel()} elements, more than its padded shard size {padded}")


@torch.library.custom_op("fsdp_compile::quantized_all_gather_copy_in", mutates_args=("out_data", "out_scales"))
def quantized_all_gather_copy_in(
    shards: list[torch.Tensor], padded_numels: list[int], out_data: torch.Tensor, out_scales: torch.Tensor, block_size: int
) -> None:
    """Quantize N shards, each zero-padded to its slot, into this rank's row ``out_data`` and its scales.

    ``padded_numels`` are the per-rank chunk sizes ``all_gather_copy_in`` takes; each chunk gets
    a slot of whole blocks (see [Note: quantized all-gather layout] in ``quantized_reference.py``).

    Example (int8, blocks of 128, a weight chunk of 200 elements and a bias chunk of 3: slots 256 and 128)::

        data, scales = torch.empty(384, dtype=torch.int8), torch.empty(3)
        torch.ops.fsdp_compile.quantized_all_gather_copy_in([w_shard, b_shard], [200, 3], data, scales, 128)
    """
    check_quantized_all_gather_copy_in(shards, padded_numels, out_data, out_scales, block_size)
    quantized_reference.quantized_all_gather_copy_in(shards, padded_numels, out_data, out_scales, block_size)


@torch.library.custom_op("fsdp_compile::quantized_all_gather_copy_out", mutates_args=("outs",))
def quantized_all_gather_copy_out(
    gathered_data: torch.Tensor,
    gathered_scales: torch.Tensor,
    padded_numels: list[int],
    outs: list[torch.Tensor],
    block_size: int,
) -> None:
    """Dequantize the gathered ``[world, total]`` rows into N unsharded parameters (unpadded, cast to each dtype).

    Example (world 2, continuing the copy-in example)::

        torch.ops.fsdp_compile.quantized_all_gather_copy_out(data_2x384, scales_2x3, [200, 3], [w, b], 128)
    """
    check_quantized_all_gather_copy_out(gathered_data, gathered_scales, padded_numels, outs, block_size)
    quantized_reference.quantized_all_gather_copy_out(gathered_data, gathered_scales, padded_numels, outs, block_size)


@torch.library.custom_op("fsdp_compile::sum_rows_copy_out", mutates_args=("outs",))
def sum_rows_copy_out(
    received: torch.Tensor, padded_numels: list[int], outs: list[torch.Tensor], post_divide: float, accumulate: bool,
    own_row: torch.Tensor | None = None, own_rank: int = 0,
) -> None:
    """Sum the ``[world, total]`` received chunks in float32 (rank order), divide, and write or add into N shard grads.

    ``own_row`` (float32, ``[total]``), when given, stands in for row ``own_rank``: this rank's
    own chunk, which needs no wire and so no rounding.

    Example (the bf16-wire reduction: all-to-all of bf16 chunks, then this on rank 1)::

        torch.ops.fsdp_compile.sum_rows_copy_out(received_bf16, [6, 2], [w_grad, b_grad], 2.0, False, own_fp32, 1)
    """
    check_sum_rows_copy_out(received, padded_numels, outs, post_divide, accumulate, own_row, own_rank)
    quantized_reference.sum_rows_copy_out(received, padded_numels, outs, post_divide, accumulate, own_row, own_rank)
