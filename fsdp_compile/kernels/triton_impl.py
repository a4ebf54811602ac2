"""Triton kernels for the four copy operations: the CUDA implementation of ``torch.ops.fsdp_compile.*``.

Each kernel sits beside its launcher; ``reference.py`` defines what both compute (layout,
order of casts and divides). One launch per call, whatever the number of parameters:

* The launcher writes a small int64 **metadata** tensor for the group's N parameters,
  ``[addresses | numels | padded | offsets | block_starts]`` (4N + N+1 entries). ``addresses``
  are the data pointers of the per-parameter tensors (shards, unsharded outputs, gradients),
  ``numels`` their element counts, ``padded``/``offsets`` the per-rank column range of each
  parameter in the flat buffer, and ``block_starts`` the prefix sum of how many BLOCK-sized
  column blocks each parameter needs (an empty parameter needs none and owns no program).
* The grid is **segment-indexed**: axis 0 enumerates all column blocks of all parameters;
  a program binary-searches ``block_starts`` for its parameter (log2 N scalar loads that hit
  cache) and handles ``BLOCK`` consecutive columns of it. For the two ``[world, total]``
  buffers axis 1 is the rank row, so program ``(b, r)`` moves one block of chunk ``r``.

Dtypes: every role holds one dtype per call (all shards one dtype, all outputs one dtype),
each of float32, bfloat16, float16. The kernels never use Triton's float casts to narrow:
the buffers are read and written as raw integer words, widened exactly to float32 for
arithmetic, and narrowed by integer round-to-nearest-even (see `_f32_bits_to_bf16`) so the
GPU and the interpreter (whose fp32->bf16 cast truncates) agree with ``Tensor.to`` bit for bit.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from fsdp_compile.kernels import ops, reference

__all__ = [
    "all_gather_copy_in",
    "all_gather_copy_out",
    "reduce_scatter_copy_in",
    "reduce_scatter_copy_out",
    "register_cuda_kernels",
    "SUPPORTED_DTYPES",
]

# Elements per program. Memory bound: 2048 x 4 warps gives each thread 16 elements, enough
# loads in flight to hide latency while keeping ~100K+ programs for a 1 GB group.
BLOCK_SIZE = 2048
NUM_WARPS = 4

# Dtype codes the kernels specialize on (constexpr).
_FP32 = tl.constexpr(0)
_BF16 = tl.constexpr(1)
_FP16 = tl.constexpr(2)
# Both CUDA's cvt.rn.{bf16,f16}.f32 and our narrowing write this canonical NaN for any NaN.
# (torch on CPU is itself inconsistent here: its vector path writes 0xFFFF for bf16 and its
# scalar tail 0x7FC0, so NaN payloads are the one thing no implementation can match bit for bit.)
_NAN_BF16 = tl.constexpr(0x7FFF)
_NAN_FP16 = tl.constexpr(0x7FFF)

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
SUPPORTED_DTYPES = tuple(_DTYPE_CODES)
# The kernels address every buffer through integer words of the same width.
_WORD_DTYPE = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


# --------------------------------------------------------------------------------------------
# Shared device helpers (inlined into every kernel)
# --------------------------------------------------------------------------------------------


@triton.jit
def _find_param(block_starts_ptr, num_params, block_id):
    """Index i with block_starts[i] <= block_id < block_starts[i + 1]; parameters with no block are skipped."""
    # `block_id * 0` instead of a literal: loop-carried values must be tensors, and num_params
    # may arrive as a constexpr (Triton specializes integer arguments equal to 1).
    lo = block_id * 0
    hi = lo + num_params
    while hi - lo > 1:
        mid = (lo + hi) // 2
        go_right = tl.load(block_starts_ptr + mid) <= block_id
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def _word_pointer(address, DTYPE: tl.constexpr):
    """Turn a data pointer taken from the metadata into a pointer to words of DTYPE's width."""
    if DTYPE == _FP32:
        pointer = address.to(tl.pointer_type(tl.int32))
    else:
        pointer = address.to(tl.pointer_type(tl.int16))
    return pointer


@triton.jit
def _load_bits(pointer, mask, DTYPE: tl.constexpr):
    """Raw bits of DTYPE values, zero-extended to uint32; masked-off lanes read as +0.0."""
    words = tl.load(pointer, mask=mask, other=0)
    if DTYPE == _FP32:
        bits = words.to(tl.uint32, bitcast=True)
    else:
        bits = words.to(tl.uint16, bitcast=True).to(tl.uint32)
    return bits


@triton.jit
def _store_bits(pointer, bits, mask, DTYPE: tl.constexpr):
    if DTYPE == _FP32:
        tl.store(pointer, bits.to(tl.int32, bitcast=True), mask=mask)
    else:
        tl.store(pointer, bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)


@triton.jit
def _bits_to_f32(bits, DTYPE: tl.constexpr):
    """Widen exactly: every bf16 and fp16 value is a float32 value."""
    if DTYPE == _FP32:
        value = bits.to(tl.float32, bitcast=True)
    elif DTYPE == _BF16:
        value = (bits << 16).to(tl.float32, bitcast=True)
    else:
        value = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return value


@triton.jit
def _f32_bits_to_bf16(bits):
    """Round float32 bits to bfloat16 bits, nearest even: bf16 is the top half of fp32, same exponent.

    Adding 0x7FFF plus the kept LSB carries into the top half exactly when the dropped half is
    above the midpoint, or at it with an odd LSB; a carry out of the mantissa bumps the
    exponent, which also rounds the largest finite values to inf as IEEE requires.
    """
    magnitude = bits & 0x7FFFFFFF
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(magnitude > 0x7F800000, _NAN_BF16, rounded)


@triton.jit
def _f32_bits_to_fp16(bits):
    """Round float32 bits to float16 bits, nearest even, with fp16's narrower exponent range.

    Four ranges of |x|: at least 65520 (the midpoint between 65504 and 2**16, a tie that rounds
    to even 2**16) becomes inf; normal fp16 values re-bias the exponent and round the 13
    dropped mantissa bits like bf16; fp16 subnormals (below 2**-14) are the 24-bit significand
    shifted to units of 2**-24, rounded on the shifted-out bits; at most 2**-25 (a tie with
    zero) becomes zero.
    """
    sign = (bits >> 16) & 0x8000
    magnitude = bits & 0x7FFFFFFF

    rebiased = magnitude - 0x38000000  # exponent 127 bias -> 15 bias; wraps (unused) below 2**-14
    normal = (rebiased + 0xFFF + ((rebiased >> 13) & 1)) >> 13

    # Shift in [1, 24] for every lane, so the lanes where this branch is not taken stay defined.
    shift = tl.maximum(tl.minimum(126 - (magnitude >> 23), 24), 1)
    significand = (magnitude & 0x7FFFFF) | 0x800000
    truncated = significand >> shift
    remainder = significand & ((1 << shift) - 1)
    halfway = 1 << (shift - 1)
    round_up = (remainder > halfway) | ((remainder == halfway) & ((truncated & 1) == 1))
    subnormal = truncated + round_up.to(tl.uint32)

    result = tl.where(magnitude < 0x38800000, subnormal, normal)
    result = tl.where(magnitude <= 0x33000000, 0, result)
    result = tl.where(magnitude >= 0x477FF000, 0x7C00, result)
    return tl.where(magnitude > 0x7F800000, _NAN_FP16, result | sign)


@triton.jit
def _f32_to_bits(value, DTYPE: tl.constexpr):
    bits = value.to(tl.uint32, bitcast=True)
    if DTYPE == _BF16:
        bits = _f32_bits_to_bf16(bits)
    elif DTYPE == _FP16:
        bits = _f32_bits_to_fp16(bits)
    return bits


@triton.jit
def _cast_bits(bits, SRC: tl.constexpr, DST: tl.constexpr):
    """``Tensor.to`` on raw bits; a same-dtype copy moves the bits untouched, NaN payloads included."""
    if SRC == DST:
        result = bits
    else:
        result = _f32_to_bits(_bits_to_f32(bits, SRC), DST)
    return result


@triton.jit
def _divide_bits(bits, divisor, reciprocal, DTYPE: tl.constexpr, BY_RECIPROCAL: tl.constexpr):
    """``t / divisor`` in DTYPE as torch computes it: in float32 (opmath), rounded back to DTYPE.

    torch's CUDA kernel for a tensor divided by a Python scalar multiplies by the float32
    reciprocal instead; BY_RECIPROCAL selects that so each device matches its own reference.
    """
    value = _bits_to_f32(bits, DTYPE)
    if BY_RECIPROCAL:
        value = value * reciprocal
    else:
        value = tl.math.div_rn(value, divisor)
    return _f32_to_bits(value, DTYPE)


# --------------------------------------------------------------------------------------------
# all_gather_copy_in
# --------------------------------------------------------------------------------------------


@triton.jit
def _all_gather_copy_in_kernel(
    metadata_ptr,
    num_params,
    out_ptr,
    SRC: tl.constexpr,
    DST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Shards (SRC, addresses in metadata) -> this rank's flat row ``out`` (DST words), zero-padded.

    Grid ``(sum_i cdiv(padded_i, BLOCK),)``: program b finds its parameter i and writes columns
    ``[k, k + BLOCK)`` of ``out[offset_i : offset_i + padded_i]``: the cast shard below
    ``numel_i``, zeros from there to ``padded_i``.
    """
    block_id = tl.program_id(0)
    param = _find_param(metadata_ptr + 4 * num_params, num_params, block_id)
    address = tl.load(metadata_ptr + param)
    numel = tl.load(metadata_ptr + num_params + param)
    padded = tl.load(metadata_ptr + 2 * num_params + param)
    offset = tl.load(metadata_ptr + 3 * num_params + param)
    first_block = tl.load(metadata_ptr + 4 * num_params + param)

    columns = (block_id - first_block) * BLOCK + tl.arange(0, BLOCK)
    bits = _load_bits(_word_pointer(address, SRC) + columns, columns < numel, SRC)
    _store_bits(out_ptr + offset + columns, _cast_bits(bits, SRC, DST), columns < padded, DST)


def all_gather_copy_in(shards: list[torch.Tensor], padded_numels: list[int], out: torch.Tensor) -> None:
    """Triton version of ``reference.all_gather_copy_in``: one launch for all shards.

    Example::

        out = torch.empty(8, dtype=torch.bfloat16, device="cuda")
        all_gather_copy_in([w.reshape(-1)[:3], b[:1]], [6, 2], out)  # w shard, 3 zeros, b shard, 1 zero
    """
    ops.check_all_gather_copy_in(shards, padded_numels, out)
    op = "all_gather_copy_in"
    src = _common_dtype(op, "shards", shards)
    dst = _common_dtype(op, "out", [out])
    _check_launchable(op, out.device)
    src, dst, padded_numels, per_word = _in_words(src, dst, shards, padded_numels, out)
    num_blocks = [triton.cdiv(padded, BLOCK_SIZE) for padded in padded_numels]
    if sum(num_blocks) == 0:
        return
    metadata = _metadata(shards, padded_numels, num_blocks, out.device, per_word)
    _all_gather_copy_in_kernel[(sum(num_blocks),)](
        metadata,
        len(shards),
        out.view(_WORD_DTYPE[dst]),
        SRC=_DTYPE_CODES[src],
        DST=_DTYPE_CODES[dst],
        BLOCK=BLOCK_SIZE,
        num_warps=NUM_WARPS,
    )


# --------------------------------------------------------------------------------------------
# all_gather_copy_out
# --------------------------------------------------------------------------------------------


@triton.jit
def _all_gather_copy_out_kernel(
    metadata_ptr,
    num_params,
    gathered_ptr,
    total,
    SRC: tl.constexpr,
    DST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``gathered`` [world, total] (SRC words) -> unsharded outputs (DST, addresses in metadata).

    Grid ``(sum_i cdiv(padded_i, BLOCK), world)``: program (b, r) copies columns
    ``[k, k + BLOCK)`` of rank r's chunk of parameter i to flat positions ``r * padded_i + k ...``
    of output i, keeping those below ``numel_i`` (the padding of the last chunk is dropped).
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
    bits = _load_bits(gathered_ptr + row * total + offset + columns, mask, SRC)
    _store_bits(_word_pointer(address, DST) + flat, _cast_bits(bits, SRC, DST), mask, DST)


def all_gather_copy_out(gathered: torch.Tensor, padded_numels: list[int], outs: list[torch.Tensor]) -> None:
    """Triton version of ``reference.all_gather_copy_out``: one launch for all outputs.

    Example::

        gathered = torch.randn(2, 8, device="cuda")            # world 2, params padded to 6 and 2
        w, b = torch.empty(4, 3, device="cuda"), torch.empty(3, device="cuda")
        all_gather_copy_out(gathered, [6, 2], [w, b])          # w = gathered[0, :6] ++ gathered[1, :6]
    """
    ops.check_all_gather_copy_out(gathered, padded_numels, outs)
    op = "all_gather_copy_out"
    src = _common_dtype(op, "gathered", [gathered])
    dst = _common_dtype(op, "outs", outs)
    _check_launchable(op, gathered.device)
    world, total = gathered.shape
    src, dst, padded_numels, per_word = _in_words(src, dst, outs, padded_numels, gathered)
    num_blocks = [triton.cdiv(padded, BLOCK_SIZE) for padded in padded_numels]
    if sum(num_blocks) == 0 or world == 0:
        return
    metadata = _metadata(outs, padded_numels, num_blocks, gathered.device, per_word)
    _all_gather_copy_out_kernel[(sum(num_blocks), world)](
        metadata,
        len(outs),
        gathered.view(_WORD_DTYPE[src]),
        total // per_word,
        SRC=_DTYPE_CODES[src],
        DST=_DTYPE_CODES[dst],
        BLOCK=BLOCK_SIZE,
        num_warps=NUM_WARPS,
    )


# --------------------------------------------------------------------------------------------
# reduce_scatter_copy_in
# --------------------------------------------------------------------------------------------


@triton.jit
def _reduce_scatter_copy_in_kernel(
    metadata_ptr,
    num_params,
    out_ptr,
    total,
    divisor,
    reciprocal,
    SRC: tl.constexpr,
    DST: tl.constexpr,
    DIVIDE: tl.constexpr,
    BY_RECIPROCAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Unsharded gradients (SRC, addresses in metadata) -> ``out`` [world, total] (DST words).

    Grid ``(sum_i cdiv(padded_i, BLOCK), world)``: program (b, r) fills columns ``[k, k + BLOCK)``
    of rank r's chunk of parameter i from flat gradient positions ``r * padded_i + k ...``, zeros
    past ``numel_i``. Cast first, then divide in DST, as the reference's ``copy_`` then
    ``div_`` do (so the zeros are divided too: 0 / -2 is -0.0).
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
    in_chunk = columns < padded
    bits = _load_bits(_word_pointer(address, SRC) + flat, in_chunk & (flat < numel), SRC)
    bits = _cast_bits(bits, SRC, DST)
    if DIVIDE:
        bits = _divide_bits(bits, divisor, reciprocal, DST, BY_RECIPROCAL)
    _store_bits(out_ptr + row * total + offset + columns, bits, in_chunk, DST)


def reduce_scatter_copy_in(
    grads: list[torch.Tensor], padded_numels: list[int], out: torch.Tensor, pre_divide: float
) -> None:
    """Triton version of ``reference.reduce_scatter_copy_in``: one launch for all gradients.

    Example::

        out = torch.empty(2, 8, dtype=torch.bfloat16, device="cuda")
        reduce_scatter_copy_in([w_grad, b_grad], [6, 2], out, pre_divide=2.0)
    """
    ops.check_reduce_scatter_copy_in(grads, padded_numels, out, pre_divide)
    op = "reduce_scatter_copy_in"
    src = _common_dtype(op, "grads", grads)
    dst = _common_dtype(op, "out", [out])
    _check_launchable(op, out.device)
    world, total = out.shape
    src, dst, padded_numels, per_word = _in_words(src, dst, grads, padded_numels, out, bit_copy=pre_divide == 1.0)
    num_blocks = [triton.cdiv(padded, BLOCK_SIZE) for padded in padded_numels]
    if sum(num_blocks) == 0 or world == 0:
        return
    metadata = _metadata(grads, padded_numels, num_blocks, out.device, per_word)
    divisor, reciprocal = _divisor_and_reciprocal(pre_divide)
    _reduce_scatter_copy_in_kernel[(sum(num_blocks), world)](
        metadata,
        len(grads),
        out.view(_WORD_DTYPE[dst]),
        total // per_word,
        divisor,
        reciprocal,
        SRC=_DTYPE_CODES[src],
        DST=_DTYPE_CODES[dst],
        DIVIDE=pre_divide != 1.0,
        BY_RECIPROCAL=out.device.type == "cuda",
        BLOCK=BLOCK_SIZE,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )


# --------------------------------------------------------------------------------------------
# reduce_scatter_copy_out
# --------------------------------------------------------------------------------------------


@triton.jit
def _reduce_scatter_copy_out_kernel(
    metadata_ptr,
    num_params,
    reduced_ptr,
    divisor,
    reciprocal,
    SRC: tl.constexpr,
    DST: tl.constexpr,
    DIVIDE: tl.constexpr,
    BY_RECIPROCAL: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Reduced shard ``reduced`` [total] (SRC words) -> sharded gradients (DST, addresses in metadata).

    Grid ``(sum_i cdiv(numel_i, BLOCK),)``: program b handles elements ``[k, k + BLOCK)`` of
    gradient i, reading ``reduced[offset_i + k ...]``. Divide in SRC, cast to DST, then add to
    the old gradient in DST: three roundings, like ``value / d``, ``.to()``, ``out.add_()``.
    """
    block_id = tl.program_id(0)
    param = _find_param(metadata_ptr + 4 * num_params, num_params, block_id)
    address = tl.load(metadata_ptr + param)
    numel = tl.load(metadata_ptr + num_params + param)
    offset = tl.load(metadata_ptr + 3 * num_params + param)
    first_block = tl.load(metadata_ptr + 4 * num_params + param)

    columns = (block_id - first_block) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < numel
    bits = _load_bits(reduced_ptr + offset + columns, mask, SRC)
    if DIVIDE:
        bits = _divide_bits(bits, divisor, reciprocal, SRC, BY_RECIPROCAL)
    bits = _cast_bits(bits, SRC, DST)
    destination = _word_pointer(address, DST) + columns
    if ACCUMULATE:
        old = _bits_to_f32(_load_bits(destination, mask, DST), DST)
        bits = _f32_to_bits(old + _bits_to_f32(bits, DST), DST)
    _store_bits(destination, bits, mask, DST)


def reduce_scatter_copy_out(
    reduced: torch.Tensor,
    padded_numels: list[int],
    outs: list[torch.Tensor],
    post_divide: float,
    accumulate: bool,
) -> None:
    """Triton version of ``reference.reduce_scatter_copy_out``: one launch for all gradients.

    Example::

        reduced = torch.randn(8, device="cuda")                # padded sizes 6 and 2
        w_grad, b_grad = torch.zeros(2, 3, device="cuda"), torch.zeros(1, device="cuda")
        reduce_scatter_copy_out(reduced, [6, 2], [w_grad, b_grad], post_divide=4.0, accumulate=True)
    """
    ops.check_reduce_scatter_copy_out(reduced, padded_numels, outs, post_divide, accumulate)
    op = "reduce_scatter_copy_out"
    src = _common_dtype(op, "reduced", [reduced])
    dst = _common_dtype(op, "outs", outs)
    _check_launchable(op, reduced.device)
    bit_copy = post_divide == 1.0 and not accumulate
    src, dst, padded_numels, per_word = _in_words(src, dst, outs, padded_numels, reduced, bit_copy=bit_copy)
    num_blocks = [triton.cdiv(out.numel() // per_word, BLOCK_SIZE) for out in outs]
    if sum(num_blocks) == 0:
        return
    metadata = _metadata(outs, padded_numels, num_blocks, reduced.device, per_word)
    divisor, reciprocal = _divisor_and_reciprocal(post_divide)
    _reduce_scatter_copy_out_kernel[(sum(num_blocks),)](
        metadata,
        len(outs),
        reduced.view(_WORD_DTYPE[src]),
        divisor,
        reciprocal,
        SRC=_DTYPE_CODES[src],
        DST=_DTYPE_CODES[dst],
        DIVIDE=post_divide != 1.0,
        BY_RECIPROCAL=reduced.device.type == "cuda",
        ACCUMULATE=bool(accumulate),
        BLOCK=BLOCK_SIZE,
        num_warps=NUM_WARPS,
        # torch rounds the quotient and the sum separately; an FMA would round once.
        enable_fp_fusion=False,
    )


# --------------------------------------------------------------------------------------------
# Launcher helpers
# --------------------------------------------------------------------------------------------

INTERPRETED = isinstance(_all_gather_copy_in_kernel, InterpretedFunction)
"""True when TRITON_INTERPRET=1 was set as this module was imported: the kernels then run on CPU tensors."""


def _common_dtype(op: str, role: str, tensors: list[torch.Tensor]) -> torch.dtype | None:
    dtypes = {tensor.dtype for tensor in tensors}
    if len(dtypes) > 1:
        names = ", ".join(sorted(str(dtype) for dtype in dtypes))
        raise ValueError(
            f"fsdp_compile.kernels.{op}: the Triton kernel needs all {role} in one dtype, got {names}; "
            "cast them to one dtype or call fsdp_compile.kernels.reference instead"
        )
    dtype = next(iter(dtypes), None)
    if dtype is not None and dtype not in _DTYPE_CODES:
        raise ValueError(
            f"fsdp_compile.kernels.{op}: the Triton kernel supports {role} of dtype float32, bfloat16 or "
            f"float16, got {dtype}; call fsdp_compile.kernels.reference for other dtypes"
        )
    return dtype


def _check_launchable(op: str, device: torch.device) -> None:
    if device.type == "cuda" and not INTERPRETED:
        return
    if device.type == "cpu" and INTERPRETED:
        return
    raise ValueError(
        f"fsdp_compile.kernels.{op}: the Triton kernels run on CUDA tensors (or on CPU tensors when "
        f"TRITON_INTERPRET=1 is set before fsdp_compile.kernels.triton_impl is imported); got {device}"
        + (" in interpreter mode" if INTERPRETED else "")
    )


def _metadata(
    tensors: list[torch.Tensor],
    padded_numels: list[int],
    num_blocks: list[int],
    device: torch.device,
    per_word: int = 1,
) -> torch.Tensor:
    """``[addresses | numels | padded | offsets | block_starts]`` as one int64 tensor on ``device``.

    Sizes count kernel words of ``per_word`` elements (see [Note: 2-byte elements moved in pairs]):
    ``padded_numels`` already does, the tensors' numels are divided here.

    On CUDA the tensor is shared by every call with the same values and must not be written
    (see [Note: launch metadata kept on the device]); elsewhere it is the caller's own.
    """
    offsets = reference._offsets(padded_numels)
    block_starts, running = [], 0
    for count in num_blocks:
        block_starts.append(running)
        running += count
    block_starts.append(running)
    values = (
        *[tensor.data_ptr() for tensor in tensors],
        *[tensor.numel() // per_word for tensor in tensors],
        *padded_numels,
        *offsets,
        *block_starts,
    )
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=device)
    return _metadata_on_device(values, device)


# [Note: 2-byte elements moved in pairs]
# A kernel thread moves one word per element, so a bf16 / fp16 copy issues 2-byte loads and
# stores: on the H200 the bf16 all-gather copy-out reached 52-60% of the device's copy
# bandwidth where the fp32 one reached 79-90% (benchmarks/RESULTS.md, GPU check b2). When the
# copy changes no bit (same dtype, no divide, no accumulate) and every boundary the kernel masks
# at falls on an even element (numels, padded sizes, hence offsets and the row length) at a
# 4-byte-aligned address, two elements are one 4-byte word: the launch runs the float32 kernel
# (a raw bit copy, SRC == DST) over half as many words. Anything else keeps 2-byte words.
def _in_words(
    src: torch.dtype | None, dst: torch.dtype | None, tensors: list[torch.Tensor], padded_numels: list[int],
    buffer: torch.Tensor, bit_copy: bool = True,
) -> tuple[torch.dtype | None, torch.dtype | None, list[int], int]:
    """The launch's ``(src, dst, padded_numels, elements per kernel word)``: float32 words of two
    elements where this copy can move its 2-byte elements in pairs (the note above), else as given.
    ``bit_copy``: the copy neither divides nor accumulates."""
    pairs = (
        bit_copy and src is dst and src in (torch.bfloat16, torch.float16) and buffer.data_ptr() % 4 == 0
        and not any(padded % 2 for padded in padded_numels)
        and not any(tensor.numel() % 2 or tensor.data_ptr() % 4 for tensor in tensors)
    )
    if not pairs:
        return src, dst, padded_numels, 1
    return torch.float32, torch.float32, [padded // 2 for padded in padded_numels], 2


# [Note: launch metadata kept on the device]
# A group's copies are launched with the same tensors every step (its shards, its unsharded
# parameters' storage, its gradient buffers), so the launch metadata -- a function of the
# addresses and sizes alone -- repeats. Staging it through pinned memory and copying it to the
# device cost the host a large share of a launch on the H200 (benchmarks/kernels.py --host-profile);
# each distinct metadata is copied once instead and kept. The first copy is synchronous, so a
# launch on any stream may read the tensor at once; nothing ever writes it again. An address
# reused by another tensor of the same size yields the same values, hence the same metadata.
@functools.lru_cache(maxsize=1024)
def _metadata_on_device(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=64)
def _divisor_and_reciprocal(factor: float) -> tuple[float, float]:
    """The float32 divisor torch uses, and the float32 reciprocal its CUDA kernels multiply by."""
    divisor = torch.tensor(factor, dtype=torch.float32)
    return float(divisor), float(torch.tensor(1.0, dtype=torch.float32) / divisor)


# --------------------------------------------------------------------------------------------
# Registration as the CUDA implementation of the custom ops
# --------------------------------------------------------------------------------------------


def _kernel_supports(*roles: list[torch.Tensor]) -> bool:
    """Whether every role holds a single supported dtype, so the kernel (not the reference) can run."""
    for tensors in roles:
        dtypes = {tensor.dtype for tensor in tensors}
        if len(dtypes) > 1 or not dtypes <= set(_DTYPE_CODES):
            return False
    return True


def _cuda_all_gather_copy_in(shards: list[torch.Tensor], padded_numels: list[int], out: torch.Tensor) -> None:
    if _kernel_supports(shards, [out]):
        all_gather_copy_in(shards, padded_numels, out)
    else:
        ops.check_all_gather_copy_in(shards, padded_numels, out)
        reference.all_gather_copy_in(shards, padded_numels, out)


def _cuda_all_gather_copy_out(gathered: torch.Tensor, padded_numels: list[int], outs: list[torch.Tensor]) -> None:
    if _kernel_supports([gathered], outs):
        all_gather_copy_out(gathered, padded_numels, outs)
    else:
        ops.check_all_gather_copy_out(gathered, padded_numels, outs)
        reference.all_gather_copy_out(gathered, padded_numels, outs)


def _cuda_reduce_scatter_copy_in(
    grads: list[torch.Tensor], padded_numels: list[int], out: torch.Tensor, pre_divide: float
) -> None:
    if _kernel_supports(grads, [out]):
        reduce_scatter_copy_in(grads, padded_numels, out, pre_divide)
    else:
        ops.check_reduce_scatter_copy_in(grads, padded_numels, out, pre_divide)
        reference.reduce_scatter_copy_in(grads, padded_numels, out, pre_divide)


def _cuda_reduce_scatter_copy_out(
    reduced: torch.Tensor, padded_numels: list[int], outs: list[torch.Tensor], post_divide: float, accumulate: bool
) -> None:
    if _kernel_supports([reduced], outs):
        reduce_scatter_copy_out(reduced, padded_numels, outs, post_divide, accumulate)
    else:
        ops.check_reduce_scatter_copy_out(reduced, padded_numels, outs, post_divide, accumulate)
        reference.reduce_scatter_copy_out(reduced, padded_numels, outs, post_divide, accumulate)


def register_cuda_kernels() -> bool:
    """Make the Triton kernels the CUDA implementation of ``torch.ops.fsdp_compile.*``.

    Called once by ``fsdp_compile.kernels`` on import. Groups the kernels cannot take (mixed
    dtypes within a role, float64) fall back to the reference on the same device. Returns
    whether the kernels were registered (not in interpreter mode, whose kernels need CPU tensors).
    """
    if INTERPRETED:
        return False
    ops.all_gather_copy_in.register_kernel("cuda")(_cuda_all_gather_copy_in)
    ops.all_gather_copy_out.register_kernel("cuda")(_cuda_all_gather_copy_out)
    ops.reduce_scatter_copy_in.register_kernel("cuda")(_cuda_reduce_scatter_copy_in)
    ops.reduce_scatter_copy_out.register_kernel("cuda")(_cuda_reduce_scatter_copy_out)
    return True
