"""Block-scaled quantization for the low-precision collectives: the definition of what the kernels compute.

Two layers:

* ``quantize_blocks`` / ``dequantize_blocks`` (and ``sum_rows``) are pure functions, no
  mutation, so they can sit inside a ``torch.compile`` graph and Inductor fuses them with the
  surrounding copies.
* ``quantized_all_gather_copy_in`` / ``quantized_all_gather_copy_out`` / ``sum_rows_copy_out``
  are the mutating implementations behind the ``torch.ops.fsdp_compile.*`` custom ops of
  ``quantized.py`` (CPU, and any device without Triton); the Triton kernels in
  ``quantized_triton.py`` reproduce them bit for bit.

Quantization, per block of ``block_size`` consecutive elements (arithmetic in float32, whatever
the input dtype; widening bf16 / fp16 to float32 is exact)::

    scale = absmax(block) / qmax          qmax = 127 (int8), 448 (float8_e4m3fn)
    data  = wire(x / scale)               int8: round half to even, clamp to [-127, 127]
                                          e4m3fn: clamp to [-448, 448], round to nearest even
    x'    = float32(data) * scale         then cast to the output dtype (nearest even)

An all-zero block has scale 0 and data 0 (the divide uses 1 in place of a zero scale).
[Note: quantization error bound] For a block whose scale is a normal float32 (absmax at least
``qmax * 2**-126``), and up to float32 rounding of the quotient and the product (a relative
``2**-23``, a few parts per million of the bound):

* int8: ``|x - x'| <= scale / 2``: the integer grid has step ``scale``. The block's largest
  element maps to exactly +-127, so one huge value only coarsens the grid of its own block.
* e4m3fn: ``|x - x'| <= 2**-4 * |x| + 2**-10 * scale``: three mantissa bits round to within
  half an ulp, ``2**-4`` relative, for normal e4m3 values (``|x / scale| >= 2**-6``), and to
  half of the smallest subnormal step ``2**-9`` (in units of the scale) below that.

Inputs must be finite: an inf or NaN makes its block's scale non-finite, so the whole block
dequantizes to NaN / inf (its data bytes are then unspecified).

[Note: quantized all-gather layout] ``reference.py``'s layout, except that each parameter's
chunk ``padded_numels[i]`` (the same per-rank size the other ops take) sits in a **slot** of
``slot_i = round_up(padded_numels[i], block_size)`` columns, zero-filled past the chunk, so no
block straddles two parameters and the unsharded parameter is still the plain rank-major
concatenation of its chunks (rounding the chunk itself up would put the rounding's zeros
between the rows of a parameter that spans several ranks)::

    data row r [total = sum(slot_i)]:  | p0 chunk r, zeros to slot_0 | p1 chunk r, zeros to slot_1 | ...
    scales row r [total / B]:          scales[j] belongs to data[j * B : (j + 1) * B]
    unsharded p_i (flat)             = row 0[s_i : s_i + padded_i] ++ row 1[s_i : ...] ++ ... [: numel_i]

where ``s_i = sum(slot[:i])``. ``quantized_slot_numels`` gives the slots, so a caller sizes
the buffers as ``sum(quantized_slot_numels(padded_numels, B))`` and that over B scales.
"""
from __future__ import annotations

import torch

from fsdp_compile.kernels import reference

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "E4M3_BYTES",
    "QMAX",
    "WIRE_DTYPES",
    "dequantize_blocks",
    "quantize_blocks",
    "quantized_all_gather_copy_in",
    "quantized_all_gather_copy_out",
    "quantized_slot_numels",
    "sum_rows",
    "sum_rows_copy_out",
    "wire_dtype_of",
]

DEFAULT_BLOCK_SIZE = 128
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
WIRE_DTYPES = tuple(QMAX)
E4M3_BYTES = torch.uint8
"""Buffer dtype the custom ops read as float8_e4m3fn bytes, for backends (gloo) without fp8."""


def _check_block_size(op: str, block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"fsdp_compile.kernels.{op}: block_size must be positive, got {block_size}")


def quantized_slot_numels(padded_numels: list[int], block_size: int) -> list[int]:
    """Each parameter's columns in the quantized buffers: its padded per-rank numel rounded up to whole blocks.

    Example: ``quantized_slot_numels([6, 1, 256], 128) == [128, 128, 256]``.
    """
    _check_block_size("quantized_slot_numels", block_size)
    return [-(-padded // block_size) * block_size for padded in padded_numels]


def wire_dtype_of(buffer_dtype: torch.dtype) -> torch.dtype:
    """The quantized dtype a wire buffer holds: uint8 buffers carry float8_e4m3fn bytes."""
    return torch.float8_e4m3fn if buffer_dtype == E4M3_BYTES else buffer_dtype


def quantize_blocks(flat: torch.Tensor, block_size: int, wire_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 1-D float tensor per block of ``block_size``: ``(data in wire_dtype, float32 scales)``.

    Pure (no mutation), so it traces into a compiled graph. See the module docstring for the
    arithmetic and [Note: quantization error bound].

    Example::

        data, scales = quantize_blocks(torch.tensor([2.5, -127.0, 0.0, 0.0]), 2, torch.int8)
        # scales = [1.0, 0.0]; data = [2, -127, 0, 0] (2.5 is a tie: it rounds to even)
    """
    op = "quantize_blocks"
    _check_block_size(op, block_size)
    if wire_dtype not in QMAX:
        raise ValueError(f"fsdp_compile.kernels.{op}: wire_dtype must be torch.int8 or torch.float8_e4m3fn, got {wire_dtype}")
    if not flat.is_floating_point() or flat.dim() != 1:
        raise ValueError(f"fsdp_compile.kernels.{op}: flat must be a 1-D float tensor, got {flat.dtype} of shape {tuple(flat.shape)}")
    if flat.numel() % block_size:
        raise ValueError(
            f"fsdp_compile.kernels.{op}: {flat.numel()} elements are not a whole number of blocks of "
            f"{block_size}; zero-pad the input to a multiple of block_size"
        )
    qmax = QMAX[wire_dtype]
    blocks = flat.to(torch.float32).view(-1, block_size)
    # A tensor divisor, not the Python scalar: CUDA torch divides by a scalar as a multiply by its
    # float32 reciprocal, 1 ulp off the correctly rounded quotient the Triton kernel (div_rn) and
    # the CPU compute (seen on an H200: 1 to 6 of 11 scales differed).
    scales = blocks.abs().amax(dim=1) / torch.full((), qmax, dtype=torch.float32, device=blocks.device)
    divisor = torch.where(scales == 0, torch.ones_like(scales), scales)
    scaled = blocks / divisor[:, None]
    if wire_dtype == torch.int8:
        data = scaled.round().clamp(-qmax, qmax).to(torch.int8)
    else:
        data = scaled.clamp(-qmax, qmax).to(torch.float8_e4m3fn)
    return data.view(-1), scales


def dequantize_blocks(
    data: torch.Tensor, scales: torch.Tensor, block_size: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of ``quantize_blocks``: ``float32(data) * scale`` per block, cast to ``out_dtype``; data's shape.

    Example::

        dequantize_blocks(*quantize_blocks(w.reshape(-1), 128, torch.int8), 128, torch.bfloat16)
    """
    op = "dequantize_blocks"
    _check_block_size(op, block_size)
    if data.numel() != scales.numel() * block_size:
        raise ValueError(
            f"fsdp_compile.kernels.{op}: {data.numel()} elements need {data.numel() // block_size} scales "
            f"of blocks of {block_size}, got {scales.numel()}"
        )
    blocks = data.reshape(-1, block_size).to(torch.float32) * scales.reshape(-1, 1).to(torch.float32)
    return blocks.to(out_dtype).view(data.shape)


def sum_rows(
    received: torch.Tensor, own_row: torch.Tensor | None = None, own_rank: int | torch.Tensor = 0
) -> torch.Tensor:
    """``received[0] + received[1] + ...`` in float32, in rank order (so every device adds alike). Pure.

    Given ``own_row`` (float32, ``received``'s row length), it stands in for row ``own_rank``: the
    chunk this rank reduces of its own gradient never went on the wire, so it is summed unrounded
    (see [Note: the gradient wire's own chunk] in collectives.py). A traced graph passes the rank
    as a 0-d tensor, read when the graph runs, and the rows are then selected by ``torch.where``.
    """
    if own_row is None:
        rows = [received[row] for row in range(received.shape[0])]
    elif isinstance(own_rank, torch.Tensor):
        rows = [torch.where(own_rank == row, own_row, received[row].to(torch.float32)) for row in range(received.shape[0])]
    else:
        rows = [own_row if row == own_rank else received[row] for row in range(received.shape[0])]
    total = rows[0].to(torch.float32)
    for row in rows[1:]:
        total = total + row.to(torch.float32)
    return total


def quantized_all_gather_copy_in(
    shards: list[torch.Tensor], padded_numels: list[int], out_data: torch.Tensor, out_scales: torch.Tensor, block_size: int
) -> None:
    """Zero-pad each shard to its slot and quantize the group's flat row into ``out_data`` / ``out_scales``."""
    slots = quantized_slot_numels(padded_numels, block_size)
    flat = torch.empty(sum(slots), dtype=torch.float32, device=out_data.device)
    reference.all_gather_copy_in(shards, slots, flat)
    wire_dtype = wire_dtype_of(out_data.dtype)
    data, scales = quantize_blocks(flat, block_size, wire_dtype)
    out_data.view(wire_dtype).copy_(data)
    out_scales.copy_(scales)


def quantized_all_gather_copy_out(
    gathered_data: torch.Tensor,
    gathered_scales: torch.Tensor,
    padded_numels: list[int],
    outs: list[torch.Tensor],
    block_size: int,
) -> None:
    """Dequantize the ``[world, total]`` gathered rows to float32, then scatter each slot's chunk as ``all_gather_copy_out``."""
    data = gathered_data.view(wire_dtype_of(gathered_data.dtype))
    values = dequantize_blocks(data, gathered_scales, block_size, torch.float32)
    slots = quantized_slot_numels(padded_numels, block_size)
    chunks = [
        values[:, offset : offset + padded]
        for offset, padded in zip(reference._offsets(slots), padded_numels)
    ]
    reference.all_gather_copy_out(torch.cat(chunks, dim=1) if chunks else values, padded_numels, outs)


def sum_rows_copy_out(
    received: torch.Tensor, padded_numels: list[int], outs: list[torch.Tensor], post_divide: float, accumulate: bool,
    own_row: torch.Tensor | None = None, own_rank: int = 0,
) -> None:
    """Sum the received ``[world, total]`` rows in float32 (``own_row`` in place of row
    ``own_rank`` when given), then write them as ``reduce_scatter_copy_out``.

    The divide happens in float32 (the sum's dtype), then the cast to each gradient's dtype,
    then the add when accumulating.
    """
    reference.reduce_scatter_copy_out(sum_rows(received, own_row, own_rank), padded_numels, outs, post_divide, accumulate)
