"""Triton kernels for the low-precision copy operations: the CUDA implementation of ``quantized.py``'s ops.

``quantized_reference.py`` defines what each kernel computes; they agree bit for bit (tested
under the interpreter). The launch scheme is ``triton_impl.py``'s (one launch per call, an
int64 metadata tensor, a segment-indexed grid with a binary search for the parameter), and
so are the raw-word loads, the exact widening to float32 and the integer round-to-nearest-even
narrowing, imported from there.

The wire formats are encoded with integer arithmetic too, never with Triton's float casts:
int8 rounds half to even with the float32 ``1.5 * 2**23`` trick, and float8_e4m3fn is
rounded and assembled bit by bit (`_f32_bits_to_e4m3`). That keeps the interpreter, which
truncates some float casts, equal to ``Tensor.to``, and lets the fp8 path run on GPUs without
fp8 conversion instructions (before sm_89).

Divisions are correctly rounded (``div_rn``) as torch computes them on CPU. On CUDA, eager
torch divides a tensor by a Python scalar as a multiply by the float32 reciprocal, and
Inductor may emit approximate divisions, so a compiled ``quantize_blocks`` can differ from
these kernels by an ulp of a scale; the error bounds hold either way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.standard import _elementwise_max
from triton.runtime.interpreter import InterpretedFunction

from fsdp_compile.kernels import quantized, quantized_reference, reference
from fsdp_compile.kernels.triton_impl import (
    _DTYPE_CODES,
    _FP32,
    _WORD_DTYPE,
    BLOCK_SIZE,
    NUM_WARPS,
    _bits_to_f32,
    _cast_bits,
    _check_launchable,
    _common_dtype,
    _divide_bits,
    _divisor_and_reciprocal,
    _f32_to_bits,
    _find_param,
    _load_bits,
    _metadata,
    _store_bits,
    _word_pointer,
)

__all__ = [
    "MAX_QUANT_BLOCK",
    "quantized_all_gather_copy_in",
    "quantized_all_gather_copy_out",
    "register_cuda_kernels",
    "sum_rows_copy_out",
]

# The quantize kernel holds whole quantization blocks in registers: ELEMENTS_PER_PROGRAM
# elements as [ELEMENTS_PER_PROGRAM // B, B] (B rounded up to a power of two). Larger
# quantization blocks than MAX_QUANT_BLOCK go to the reference.
ELEMENTS_PER_PROGRAM = 2048
MAX_QUANT_BLOCK = 8192

_INT8 = tl.constexpr(0)
_E4M3 = tl.constexpr(1)
# 1.5 * 2**23: adding and subtracting it rounds a float32 of magnitude below 2**22 to an
# integer, half to even (the sum's ulp is 1).
_ROUND_MAGIC = tl.constexpr(12582912.0)
_E4M3_NAN = tl.constexpr(0x7FC00000)


def _wire_code(buffer_dtype: torch.dtype) -> int:
    return 0 if buffer_dtype == torch.int8 else 1


# --------------------------------------------------------------------------------------------
# Wire format helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def _round_to_int8(scaled):
    """Clamp to [-127, 127] and round half to even (clamping first is the same: the bounds are integers)."""
    clamped = tl.minimum(tl.maximum(scaled, -127.0), 127.0)
    return ((clamped + _ROUND_MAGIC) - _ROUND_MAGIC).to(tl.int8)


@triton.jit
def _f32_bits_to_e4m3(bits):
    """Round float32 bits of |x| <= 448 to float8_e4m3fn bits (bias 7, 3 mantissa bits), nearest even.

    Normal e4m3 values (|x| >= 2**-6) re-bias the exponent and round the 20 dropped mantissa
    bits with the carry trick of `_f32_bits_to_bf16`; below that, e4m3 subnormals count units
    of 2**-9: the 24-bit significand shifted right by 141 - exponent, rounded on the shifted-out
    bits (a carry to 8 units is 2**-6's encoding, as it should be); at most 2**-10 (a tie with
    zero) becomes zero. The sign is kept, so -0.0 encodes as 0x80 like ``Tensor.to``.
    """
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF

    rebiased = magnitude - 0x3C000000  # exponent 127 bias -> 7 bias; wraps (unused) below 2**-6
    normal = (rebiased + 0x7FFFF + ((rebiased >> 20) & 1)) >> 20

    # Shift in [21, 24] for every lane, so the lanes where this branch is not taken stay defined.
    shift = tl.maximum(tl.minimum(141 - (magnitude >> 23), 24), 21)
    significand = (magnitude & 0x7FFFFF) | 0x800000
    truncated = significand >> shift
    remainder = significand & ((1 << shift) - 1)
    halfway = 1 << (shift - 1)
    round_up = (remainder > halfway) | ((remainder == halfway) & ((truncated & 1) == 1))
    subnormal = truncated + round_up.to(tl.uint32)

    result = tl.where(magnitude < 0x3C800000, subnormal, normal)
    result = tl.where(magnitude <= 0x3A800000, 0, result)
    return result | sign


@triton.jit
def _e4m3_bits_to_f32(bits):
    """Widen float8_e4m3fn bits (zero-extended to uint32) to float32, exactly; 0x7F / 0xFF are NaN."""
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    normal = ((exponent + 120) << 23) | (mantissa << 20)
    subnormal = (mantissa.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)  # mantissa * 2**-9
    magnitude = tl.where(exponent == 0, subnormal, normal)
    magnitude = tl.where((bits & 0x7F) == 0x7F, _E4M3_NAN, magnitude)
    return (magnitude | ((bits & 0x80) << 24)).to(tl.float32, bitcast=True)


# --------------------------------------------------------------------------------------------
# quantized_all_gather_copy_in
# --------------------------------------------------------------------------------------------


@triton.jit
def _quantized_all_gather_copy_in_kernel(
    metadata_ptr,
    num_params,
    data_ptr,
    scales_ptr,
    block_size,
    qmax,
    SRC: tl.constexpr,
    WIRE: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
):
    """Shards (SRC, addresses in metadata) -> this rank's row ``data`` (int8 words) and ``scales`` (float32).

    The metadata's padded sizes and offsets are the slots'. Grid ``(sum_i cdiv(slot_i / B, ROWS),)``:
    program b finds its parameter i and quantizes blocks ``[k, k + ROWS)`` of it, a
    ``[ROWS, COLUMNS]`` tile (B <= COLUMNS, the power of two at or above B; the extra lanes are
    masked). Block j of parameter i covers its flat positions ``[j * B, (j + 1) * B)``: the shard
    below ``numel_i``, zeros up to ``slot_i``. It lands in ``data[offset_i + j * B ...]`` and
    ``scales[offset_i / B + j]``.
    """
    program = tl.program_id(0)
    param = _find_param(metadata_ptr + 4 * num_params, num_params, program)
    address = tl.load(metadata_ptr + param)
    numel = tl.load(metadata_ptr + num_params + param)
    padded = tl.load(metadata_ptr + 2 * num_params + param)
    offset = tl.load(metadata_ptr + 3 * num_params + param)
    first_block = tl.load(metadata_ptr + 4 * num_params + param)

    blocks = (program - first_block) * ROWS + tl.arange(0, ROWS)
    lanes = tl.arange(0, COLUMNS)
    positions = blocks[:, None] * block_size + lanes[None, :]
    real_block = blocks < padded // block_size
    in_block = real_block[:, None] & (lanes[None, :] < block_size)
    bits = _load_bits(_word_pointer(address, SRC) + positions, in_block & (positions < numel), SRC)
    values = _bits_to_f32(bits, SRC)

    # tl.reduce with max's own combine function is tl.max; spelled out because tl.max is a
    # JITFunction the interpreter cannot call unless triton.language itself was imported interpreted.
    scales = tl.math.div_rn(tl.reduce(tl.abs(values), 1, _elementwise_max), qmax)
    divisor = tl.where(scales == 0, 1.0, scales)
    scaled = tl.math.div_rn(values, divisor[:, None])
    if WIRE == _INT8:
        words = _round_to_int8(scaled)
    else:
        clamped = tl.minimum(tl.maximum(scaled, -448.0), 448.0)
        words = _f32_bits_to_e4m3(clamped.to(tl.uint32, bitcast=True)).to(tl.uint8).to(tl.int8, bitcast=True)
    tl.store(data_ptr + offset + positions, words, mask=in_block)
    tl.store(scales_ptr + offset // block_size + blocks, scales, mask=real_block)


def quantized_all_gather_copy_in(
    shards: list[torch.Tensor], padded_numels: list[int], out_data: torch.Tensor, out_scales: torch.Tensor, block_size: int
) -> None:
    """Triton version of ``quantized_reference.quantized_all_gather_copy_in``: one launch for all shards.

    Example::

        data, scales = torch.empty(384, dtype=torch.int8, device="cuda"), torch.empty(3, device="cuda")
        quantized_all_gather_copy_in([w_shard, b_shard], [256, 128], data, scales, 128)
    """
    quantized.check_quantized_all_gather_copy_in(shards, padded_numels, out_data, out_scales, block_size)
    op = "quantized_all_gather_copy_in"
    _check_kernel_block(op, block_size)
    src = _common_dtype(op, "shards", shards)
    _check_launchable(op, out_data.device)
    columns = triton.next_power_of_2(block_size)
    rows = max(1, ELEMENTS_PER_PROGRAM // columns)
    slots = quantized_reference.quantized_slot_numels(padded_numels, block_size)
    num_blocks = [triton.cdiv(slot // block_size, rows) for slot in slots]
    if sum(num_blocks) == 0:
        return
    wire = quantized_reference.wire_dtype_of(out_data.dtype)
    metadata = _metadata(shards, slots, num_blocks, out_data.device)
    _quantized_all_gather_copy_in_kernel[(sum(num_blocks),)](
        metadata,
        len(shards),
        out_data.view(torch.int8),
        out_scales,
        block_size,
        quantized_reference.QMAX[wire],
        SRC=_DTYPE_CODES[src],
        WIRE=_wire_code(out_data.dtype),
        ROWS=rows,
        COLUMNS=columns,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )


# --------------------------------------------------------------------------------------------
# quantized_all_gather_copy_out
# --------------------------------------------------------------------------------------------


@triton.jit
def _quantized_all_gather_copy_out_kernel(
    metadata_ptr,
    num_params,
    data_ptr,
    scales_ptr,
    total,
    block_size,
    WIRE: tl.constexpr,
    DST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Gathered ``data`` [world, total] (int8 words) and ``scales`` [world, total / B] -> unsharded outputs (DST).

    The metadata's offsets are the slots' (`_slot_metadata`), its padded sizes the chunks'.
    Grid ``(sum_i cdiv(padded_i, BLOCK), world)``: program (b, r) dequantizes columns
    ``[k, k + BLOCK)`` of rank r's chunk of parameter i, each with the scale of its block,
    ``scales[r, (offset_i + column) / B]``, into flat positions ``r * padded_i + k ...`` of
    output i, keeping those below ``numel_i`` (as ``all_gather_copy_out``).
    """
    block_id = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    param = _find_param(metadata_ptr + 4 * num_params, num_params, block_id)
    address = tl.load(metadata_ptr + param)
    numel = tl.load(metadata_ptr + num_params + param)
    padded = tl.load(metadata_ptr + 2 * num_params + param)
    offset = tl.load(metadata_ptr + 3 * num_params + param)
    first_block = tl.load(metadata_ptr + 4 * num_params + param)

    columns = (block_id - first_block) * BLOCK + tl.arange(0, BLOCK)
    flat = row * padded + columns
    mask = (columns < padded) & (flat < numel)
    words = tl.load(data_ptr + row * total + offset + columns, mask=mask, other=0)
    if WIRE == _INT8:
        quantized_values = words.to(tl.float32)
    else:
        quantized_values = _e4m3_bits_to_f32(words.to(tl.uint8, bitcast=True).to(tl.uint32))
    scale = tl.load(scales_ptr + row * (total // block_size) + (offset + columns) // block_size, mask=mask, other=0.0)
    value = quantized_values * scale
    _store_bits(_word_pointer(address, DST) + flat, _f32_to_bits(value, DST), mask, DST)


def quantized_all_gather_copy_out(
    gathered_data: torch.Tensor,
    gathered_scales: torch.Tensor,
    padded_numels: list[int],
    outs: list[torch.Tensor],
    block_size: int,
) -> None:
    """Triton version of ``quantized_reference.quantized_all_gather_copy_out``: one launch for all outputs.

    Example::

        quantized_all_gather_copy_out(data_2x384, scales_2x3, [256, 128], [w, b], 128)
    """
    quantized.check_quantized_all_gather_copy_out(gathered_data, gathered_scales, padded_numels, outs, block_size)
    op = "quantized_all_gather_copy_out"
    dst = _common_dtype(op, "outs", outs)
    _check_launchable(op, gathered_data.device)
    world, total = gathered_data.shape
    num_blocks = [triton.cdiv(padded, BLOCK_SIZE) for padded in padded_numels]
    if sum(num_blocks) == 0 or world == 0:
        return
    metadata = _slot_metadata(outs, padded_numels, block_size, num_blocks, gathered_data.device)
    _quantized_all_gather_copy_out_kernel[(sum(num_blocks), world)](
        metadata,
        len(outs),
        gathered_data.view(torch.int8),
        gathered_scales,
        total,
        block_size,
        WIRE=_wire_code(gathered_data.dtype),
        DST=_DTYPE_CODES[dst],
        BLOCK=BLOCK_SIZE,
        num_warps=NUM_WARPS,
    )


# --------------------------------------------------------------------------------------------
# sum_rows_copy_out
# --------------------------------------------------------------------------------------------


@triton.jit
def _sum_rows_copy_out_kernel(
    metadata_ptr,
    num_params,
    received_ptr,
    own_ptr,
    own_rank,
    total,
    divisor,
    reciprocal,
    WORLD: tl.constexpr,
    SRC: tl.constexpr,
    DST: tl.constexpr,
    HAS_OWN: tl.constexpr,
    DIVIDE: tl.constexpr,
    BY_RECIPROCAL: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Received chunks ``received`` [world, total] (SRC words) -> sharded gradients (DST, addresses in metadata).

    Grid ``(sum_i cdiv(numel_i, BLOCK),)``: program b handles elements ``[k, k + BLOCK)`` of
    gradient i, summing ``received[r, offset_i + k ...]`` over r = 0, 1, ... in float32 (row 0
    starts the sum, so a lone -0.0 survives as in the reference); with HAS_OWN, the float32 row
    ``own`` stands in for row ``own_rank``. Then as ``_reduce_scatter_copy_out_kernel`` with a
    float32 source: divide, cast, add.
    """
    block_id = tl.program_id(0)
    param = _find_param(metadata_ptr + 4 * num_params, num_params, block_id)
    address = tl.load(metadata_ptr + param)
    numel = tl.load(metadata_ptr + num_params + param)
    offset = tl.load(metadata_ptr + 3 * num_params + param)
    first_block = tl.load(metadata_ptr + 4 * num_params + param)

    columns = (block_id - first_block) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < numel
    source = received_ptr + offset + columns
    summed = _bits_to_f32(_load_bits(source, mask, SRC), SRC)
    if HAS_OWN:
        own = tl.load(own_ptr + offset + columns, mask=mask, other=0.0)
        summed = tl.where(own_rank == 0, own, summed)
    # WORLD is a constexpr (one kernel per world size, fixed in a job): Triton 3.6's interpreter
    # with numpy 2.4 cannot take a runtime scalar as a loop bound (TypeError in its __index__).
    for row in range(1, WORLD):
        source += total
        value = _bits_to_f32(_load_bits(source, mask, SRC), SRC)
        if HAS_OWN:
            value = tl.where(own_rank == row, own, value)
        summed += value
    bits = summed.to(tl.uint32, bitcast=True)
    if DIVIDE:
        bits = _divide_bits(bits, divisor, reciprocal, _FP32, BY_RECIPROCAL)
    bits = _cast_bits(bits, _FP32, DST)
    destination = _word_pointer(address, DST) + columns
    if ACCUMULATE:
        old = _bits_to_f32(_load_bits(destination, mask, DST), DST)
        bits = _f32_to_bits(old + _bits_to_f32(bits, DST), DST)
    _store_bits(destination, bits, mask, DST)


def sum_rows_copy_out(
    received: torch.Tensor, padded_numels: list[int], outs: list[torch.Tensor], post_divide: float, accumulate: bool,
    own_row: torch.Tensor | None = None, own_rank: int = 0,
) -> None:
    """Triton version of ``quantized_reference.sum_rows_copy_out``: cast, sum, divide and write in one launch.

    Example::

        received = torch.randn(4, 8, device="cuda").bfloat16()   # world 4, padded sizes 6 and 2
        sum_rows_copy_out(received, [6, 2], [w_grad, b_grad], post_divide=4.0, accumulate=False)
    """
    quantized.check_sum_rows_copy_out(received, padded_numels, outs, post_divide, accumulate, own_row, own_rank)
    op = "sum_rows_copy_out"
    src = _common_dtype(op, "received", [received])
    dst = _common_dtype(op, "outs", outs)
    _check_launchable(op, received.device)
    world, total = received.shape
    num_blocks = [triton.cdiv(out.numel(), BLOCK_SIZE) for out in outs]
    if sum(num_blocks) == 0:
        return
    metadata = _metadata(outs, padded_numels, num_blocks, received.device)
    divisor, reciprocal = _divisor_and_reciprocal(post_divide)
    _sum_rows_copy_out_kernel[(sum(num_blocks),)](
        metadata,
        len(outs),
        received.view(_WORD_DTYPE[src]),
        # Without an own row the kernel never reads this pointer; a valid one (not an empty
        # tensor's null) keeps the launcher's pointer check on CUDA satisfied.
        own_row if own_row is not None else received,
        own_rank,
        total,
        divisor,
        reciprocal,
        WORLD=world,
        SRC=_DTYPE_CODES[src],
        DST=_DTYPE_CODES[dst],
        HAS_OWN=own_row is not None,
        DIVIDE=post_divide != 1.0,
        BY_RECIPROCAL=received.device.type == "cuda",
        ACCUMULATE=bool(accumulate),
        BLOCK=BLOCK_SIZE,
        num_warps=NUM_WARPS,
        # torch rounds the sums, the quotient and the accumulation separately; an FMA would not.
        enable_fp_fusion=False,
    )


# --------------------------------------------------------------------------------------------
# Launcher helpers and registration
# --------------------------------------------------------------------------------------------

INTERPRETED = isinstance(_quantized_all_gather_copy_in_kernel, InterpretedFunction)
"""True when TRITON_INTERPRET=1 was set as this module was imported: the kernels then run on CPU tensors."""


def _check_kernel_block(op: str, block_size: int) -> None:
    if triton.next_power_of_2(block_size) > MAX_QUANT_BLOCK:
        raise ValueError(
            f"fsdp_compile.kernels.{op}: the Triton kernel quantizes blocks of at most {MAX_QUANT_BLOCK} elements, "
            f"got block_size {block_size}; use a smaller block or fsdp_compile.kernels.quantized_reference"
        )


def _slot_metadata(
    outs: list[torch.Tensor], padded_numels: list[int], block_size: int, num_blocks: list[int], device: torch.device
) -> torch.Tensor:
    """``triton_impl._metadata``'s layout with the chunks' padded sizes but the slots' offsets."""
    metadata = _metadata(outs, padded_numels, num_blocks, torch.device("cpu"))
    count = len(outs)
    slots = quantized_reference.quantized_slot_numels(padded_numels, block_size)
    metadata[3 * count : 4 * count] = torch.tensor(reference._offsets(slots), dtype=torch.int64)
    if device.type != "cuda":
        return metadata
    return metadata.pin_memory().to(device, non_blocking=True)  # see triton_impl._metadata


def _single_supported_dtype(tensors: list[torch.Tensor]) -> bool:
    dtypes = {tensor.dtype for tensor in tensors}
    return len(dtypes) <= 1 and dtypes <= set(_DTYPE_CODES)


def _cuda_quantized_all_gather_copy_in(
    shards: list[torch.Tensor], padded_numels: list[int], out_data: torch.Tensor, out_scales: torch.Tensor, block_size: int
) -> None:
    if _single_supported_dtype(shards) and 0 < block_size and triton.next_power_of_2(block_size) <= MAX_QUANT_BLOCK:
        quantized_all_gather_copy_in(shards, padded_numels, out_data, out_scales, block_size)
    else:
        quantized.check_quantized_all_gather_copy_in(shards, padded_numels, out_data, out_scales, block_size)
        quantized_reference.quantized_all_gather_copy_in(shards, padded_numels, out_data, out_scales, block_size)


def _cuda_quantized_all_gather_copy_out(
    gathered_data: torch.Tensor,
    gathered_scales: torch.Tensor,
    padded_numels: list[int],
    outs: list[torch.Tensor],
    block_size: int,
) -> None:
    if _single_supported_dtype(outs):
        quantized_all_gather_copy_out(gathered_data, gathered_scales, padded_numels, outs, block_size)
    else:
        quantized.check_quantized_all_gather_copy_out(gathered_data, gathered_scales, padded_numels, outs, block_size)
        quantized_reference.quantized_all_gather_copy_out(gathered_data, gathered_scales, padded_numels, outs, block_size)


def _cuda_sum_rows_copy_out(
    received: torch.Tensor, padded_numels: list[int], outs: list[torch.Tensor], post_divide: float, accumulate: bool,
    own_row: torch.Tensor | None = None, own_rank: int = 0,
) -> None:
    args = (received, padded_numels, outs, post_divide, accumulate, own_row, own_rank)
    if _single_supported_dtype([received]) and _single_supported_dtype(outs):
        sum_rows_copy_out(*args)
    else:
        quantized.check_sum_rows_copy_out(*args)
        quantized_reference.sum_rows_copy_out(*args)


def register_cuda_kernels() -> bool:
    """Make these kernels the CUDA implementation of the three ops of ``quantized.py``.

    Called once by ``fsdp_compile.kernels`` on import. Calls the kernels cannot take (mixed or
    float64 parameter dtypes, quantization blocks over MAX_QUANT_BLOCK) fall back to the
    reference on the same device. Returns whether the kernels were registered (not in
    interpreter mode, whose kernels need CPU tensors).
    """
    if INTERPRETED:
        return False
    quantized.quantized_all_gather_copy_in.register_kernel("cuda")(_cuda_quantized_all_gather_copy_in)
    quantized.quantized_all_gather_copy_out.register_kernel("cuda")(_cuda_quantized_all_gather_copy_out)
    quantized.sum_rows_copy_out.register_kernel("cuda")(_cuda_sum_rows_copy_out)
    return True
