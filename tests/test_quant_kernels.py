"""The low-precision collectives' kernels: quantize / dequantize bounds, op layouts, Triton (interpreted) against the reference.

The Triton kernels run under Triton's interpreter (no GPU needed), loaded as in test_kernels.py:
``quantized_triton.py`` is executed afresh with TRITON_INTERPRET=1, and so is ``triton_impl.py``,
whose device helpers it imports (an interpreted kernel can only call interpreted helpers), so
the fresh ``triton_impl`` copy stands in for the real one while ``quantized_triton`` executes.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from fsdp_compile.kernels import quantized_reference
from fsdp_compile.kernels.quantized_reference import dequantize_blocks, quantize_blocks
from fsdp_compile.runtime.layout import ShardLayout

WIRES = [torch.int8, torch.float8_e4m3fn]
WIRE_IDS = ["int8", "e4m3"]
# Float32 rounding of the quotient x / scale and of the product data * scale: a relative 2**-23
# each, so the bounds below are checked with this much slack.
FP32_SLACK = 2.0**-20
SENTINEL = -1234.5


def _load_interpreted(filename: str, name: str):
    path = os.path.join(os.path.dirname(quantized_reference.__file__), filename)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def interpreted():
    """quantized_triton.py executed with TRITON_INTERPRET=1 against a likewise interpreted triton_impl.py."""
    pytest.importorskip("triton")
    previous_env = os.environ.get("TRITON_INTERPRET")
    previous_base = sys.modules.get("fsdp_compile.kernels.triton_impl")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        base = _load_interpreted("triton_impl.py", "_fsdp_compile_triton_impl_interpreted_for_quant")
        sys.modules["fsdp_compile.kernels.triton_impl"] = base
        module = _load_interpreted("quantized_triton.py", "_fsdp_compile_quantized_triton_interpreted")
    finally:
        if previous_base is None:
            sys.modules.pop("fsdp_compile.kernels.triton_impl", None)
        else:
            sys.modules["fsdp_compile.kernels.triton_impl"] = previous_base
        if previous_env is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous_env
    assert module.INTERPRETED and base.INTERPRETED, "TRITON_INTERPRET=1 did not reach triton.jit"
    return module


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    words = {4: torch.int32, 2: torch.int16, 1: torch.int8}[actual.element_size()]
    mismatch = (actual.reshape(-1).view(words) != expected.reshape(-1).view(words)).nonzero().reshape(-1)
    if mismatch.numel():
        index = mismatch[0].item()
        raise AssertionError(
            f"{mismatch.numel()} of {actual.numel()} elements differ; first at {index}: "
            f"got {actual.reshape(-1)[index].item()}, expected {expected.reshape(-1)[index].item()}"
        )


def blocks_of_mixed_magnitude(num_blocks: int, block_size: int, seed: int) -> torch.Tensor:
    """Gaussian blocks, each scaled by its own power of ten in [1e-4, 1e4]."""
    gen = torch.Generator().manual_seed(seed)
    magnitudes = 10.0 ** torch.empty(num_blocks, 1).uniform_(-4, 4, generator=gen)
    return (torch.randn(num_blocks, block_size, generator=gen) * magnitudes).reshape(-1)


def round_trip(flat: torch.Tensor, block_size: int, wire: torch.dtype):
    data, scales = quantize_blocks(flat, block_size, wire)
    return data, scales, dequantize_blocks(data, scales, block_size, torch.float32)


def per_element_scale(scales: torch.Tensor, block_size: int) -> torch.Tensor:
    return scales.repeat_interleave(block_size)


# ---------------------------------------------------------------------------------------------
# quantize_blocks / dequantize_blocks: error bounds and corner cases
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [128, 96])
def test_int8_error_is_at_most_half_the_block_scale(block_size):
    flat = blocks_of_mixed_magnitude(64, block_size, seed=0)
    data, scales, restored = round_trip(flat, block_size, torch.int8)
    bound = per_element_scale(scales, block_size) / 2
    error = (flat - restored).abs()
    assert data.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (64,)
    assert (error <= bound * (1 + FP32_SLACK)).all(), f"worst error / bound {(error / bound).max().item()}"
    assert (error / bound).max() > 0.9, "the data never came near the bound: the check would not see a wrong scale"
    assert (data.view(64, -1).abs().amax(dim=1) == 127).all()


@pytest.mark.parametrize("block_size", [128, 96])
def test_e4m3_error_is_within_its_rounding_bound(block_size):
    flat = blocks_of_mixed_magnitude(64, block_size, seed=1)
    data, scales, restored = round_trip(flat, block_size, torch.float8_e4m3fn)
    scale = per_element_scale(scales, block_size)
    bound = 2.0**-4 * flat.abs() + 2.0**-10 * scale
    error = (flat - restored).abs()
    assert data.dtype == torch.float8_e4m3fn
    assert (error <= bound * (1 + FP32_SLACK)).all(), f"worst error / bound {(error / bound).max().item()}"
    assert (error / bound).max() > 0.5
    assert (data.float().view(64, -1).abs().amax(dim=1) == 448).all()


@pytest.mark.parametrize("wire", WIRES, ids=WIRE_IDS)
def test_all_zero_blocks_have_zero_scale_and_data_and_no_nan(wire):
    flat = torch.cat([torch.zeros(256), torch.randn(128)])
    data, scales, restored = round_trip(flat, 128, wire)
    assert torch.equal(scales[:2], torch.zeros(2)) and scales[2] > 0
    assert torch.equal(data[:256].float(), torch.zeros(256))
    assert torch.equal(restored[:256], torch.zeros(256)) and not restored.isnan().any()


@pytest.mark.parametrize("wire", WIRES, ids=WIRE_IDS)
def test_block_of_equal_values_maps_to_the_extreme_code(wire):
    flat = torch.full((128,), -3.7)
    data, scales, restored = round_trip(flat, 128, wire)
    qmax = quantized_reference.QMAX[wire]
    assert torch.equal(data.float(), torch.full((128,), -qmax))
    assert scales.item() == pytest.approx(3.7 / qmax, rel=2**-22)
    assert ((restored - flat).abs() <= 3.7 * 2.0**-22).all()


def test_one_huge_value_coarsens_only_its_own_block():
    gen = torch.Generator().manual_seed(2)
    flat = torch.randn(256, generator=gen)
    flat[5] = 1.0e6
    data, scales, restored = round_trip(flat, 128, torch.int8)
    assert restored[5] == pytest.approx(1.0e6, rel=2**-22)
    # The rest of block 0 is below half a step of 1e6 / 127: all of it flushes to zero, within the bound.
    others = torch.cat([restored[:5], restored[6:128]])
    assert torch.equal(others, torch.zeros(127))
    assert ((flat[:128] - restored[:128]).abs() <= scales[0] / 2).all()
    # Block 1 keeps its own fine scale.
    assert scales[1] < 1e-1 and ((flat[128:] - restored[128:]).abs() <= scales[1] / 2 * (1 + FP32_SLACK)).all()


def test_one_huge_value_in_e4m3_stays_within_the_relative_bound():
    gen = torch.Generator().manual_seed(3)
    flat = torch.randn(128, generator=gen)
    flat[7] = -1.0e6
    data, scales, restored = round_trip(flat, 128, torch.float8_e4m3fn)
    bound = 2.0**-4 * flat.abs() + 2.0**-10 * scales[0]
    assert ((flat - restored).abs() <= bound * (1 + FP32_SLACK)).all()
    assert (restored == 0).sum() > 100, "the small values should mostly fall below e4m3's smallest subnormal"


def test_int8_rounds_half_to_even():
    # Scale 1 (absmax 127): the quotients are the values themselves.
    flat = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5])
    data, scales = quantize_blocks(flat, 8, torch.int8)
    assert scales.item() == 1.0
    assert data.tolist() == [127, 0, 2, 2, 0, -2, -2, 126]


def test_quantize_blocks_refuses_a_partial_block():
    with pytest.raises(ValueError, match="not a whole number of blocks of 128"):
        quantize_blocks(torch.zeros(200), 128, torch.int8)
    with pytest.raises(ValueError, match="wire_dtype"):
        quantize_blocks(torch.zeros(128), 128, torch.float16)


def test_quantize_and_dequantize_trace_into_one_graph():
    def round_trip_bf16(x):
        data, scales = quantize_blocks(x, 64, torch.int8)
        return dequantize_blocks(data, scales, 64, torch.bfloat16)

    x = torch.randn(256)
    compiled = torch.compile(round_trip_bf16, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), round_trip_bf16(x))


# ---------------------------------------------------------------------------------------------
# The custom ops against a layout worked out by hand (world 2, blocks of 4)
# ---------------------------------------------------------------------------------------------
#
# p0 has shape (3, 3): 2 rows per rank, chunk 6, slot 8; p1 has shape (1,): chunk 1, slot 4.
#   rank 0's row: | p0 rows 0-1: 127 -1 63.5 3 | -254 0.5 _ _ | p1: -63.5 _ _ _ |   scales 1, 2, 0.5
#   rank 1's row: | p0 row 2:    2.5 254 -3 _  |    _    _ _ _ | p1:     _ _ _ _ |   scales 2, 0, 0
# int8 data: 63.5 -> 64 and -3 / 2 -> -2 (ties to even), 0.5 / 2 -> 0, 2.5 / 2 -> 1.

HAND_PADDED = [6, 1]
HAND_P0 = torch.tensor([[127.0, -1.0, 63.5], [3.0, -254.0, 0.5], [2.5, 254.0, -3.0]])
HAND_P1 = torch.tensor([-63.5])
HAND_DATA = torch.tensor(
    [[127, -1, 64, 3, -127, 0, 0, 0, -127, 0, 0, 0], [1, 127, -2, 0, 0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.int8
)
HAND_SCALES = torch.tensor([[1.0, 2.0, 0.5], [2.0, 0.0, 0.0]])


def hand_shards(rank: int) -> list[torch.Tensor]:
    return [HAND_P0[:2] if rank == 0 else HAND_P0[2:], HAND_P1 if rank == 0 else HAND_P1[:0]]


def test_slots_round_each_chunk_up_to_whole_blocks():
    assert quantized_reference.quantized_slot_numels(HAND_PADDED, 4) == [8, 4]
    assert quantized_reference.quantized_slot_numels([0, 128, 129], 128) == [0, 128, 256]


@pytest.mark.parametrize("rank", [0, 1])
def test_quantized_copy_in_matches_hand_layout(rank):
    data, scales = torch.full((12,), 99, dtype=torch.int8), torch.full((3,), SENTINEL)
    torch.ops.fsdp_compile.quantized_all_gather_copy_in(hand_shards(rank), HAND_PADDED, data, scales, 4)
    assert torch.equal(data, HAND_DATA[rank]) and torch.equal(scales, HAND_SCALES[rank])


def test_quantized_copy_out_matches_hand_layout():
    p0, p1 = torch.full((3, 3), SENTINEL, dtype=torch.bfloat16), torch.full((1,), SENTINEL)
    torch.ops.fsdp_compile.quantized_all_gather_copy_out(HAND_DATA, HAND_SCALES, HAND_PADDED, [p0, p1], 4)
    expected = torch.tensor([[127.0, -1.0, 64.0], [3.0, -254.0, 0.0], [2.0, 254.0, -4.0]], dtype=torch.bfloat16)
    assert torch.equal(p0, expected) and torch.equal(p1, HAND_P1)


def test_e4m3_ops_take_uint8_buffers_as_e4m3_bytes():
    # One block [448, 1]: scale 1, so the bytes are the e4m3 encodings of 448 and 1.
    data, scales = torch.zeros(2, dtype=torch.uint8), torch.zeros(1)
    torch.ops.fsdp_compile.quantized_all_gather_copy_in([torch.tensor([448.0, 1.0])], [2], data, scales, 2)
    assert data.tolist() == [0x7E, 0x38] and scales.item() == 1.0
    out = torch.zeros(2)
    torch.ops.fsdp_compile.quantized_all_gather_copy_out(data.view(1, 2), scales.view(1, 1), [2], [out], 2)
    assert out.tolist() == [448.0, 1.0]


def test_quantized_ops_round_trip_every_rank_within_the_bound():
    world, block = 3, 16
    shapes = [(7, 5), (1,), (0,), (40,)]
    padded = [ShardLayout(shape, 0, world, 0).padded_shard_numel for shape in shapes]
    total = sum(quantized_reference.quantized_slot_numels(padded, block))
    gen = torch.Generator().manual_seed(4)
    unsharded = [torch.randn(shape, generator=gen) for shape in shapes]
    data, scales = torch.empty(world, total, dtype=torch.int8), torch.empty(world, total // block)
    for rank in range(world):
        shards = [ShardLayout(t.shape, 0, world, rank).shard_of(t).contiguous() for t in unsharded]
        torch.ops.fsdp_compile.quantized_all_gather_copy_in(shards, padded, data[rank], scales[rank], block)
    rebuilt = [torch.full(shape, SENTINEL) for shape in shapes]
    torch.ops.fsdp_compile.quantized_all_gather_copy_out(data, scales, padded, rebuilt, block)
    assert padded[0] % block, "the test needs a chunk that is not a whole number of blocks"
    for restored, original in zip(rebuilt, unsharded):
        assert ((restored - original).abs() <= scales.max() / 2 * (1 + FP32_SLACK)).all()


def test_quantized_ops_refuse_buffers_sized_without_rounding_to_whole_blocks():
    with pytest.raises(ValueError, match=r"quantized_all_gather_copy_in: out_data has 6 elements but the shards' slots need 8 \(each parameter's padded numel rounded up to a multiple of block_size 4"):
        torch.ops.fsdp_compile.quantized_all_gather_copy_in([torch.ones(5)], [6], torch.empty(6, dtype=torch.int8), torch.empty(2), 4)
    with pytest.raises(ValueError, match="quantized_all_gather_copy_out: gathered_data has 6 columns but the parameters' slots need 8"):
        torch.ops.fsdp_compile.quantized_all_gather_copy_out(
            torch.empty(2, 6, dtype=torch.int8), torch.empty(2, 2), [6], [torch.empty(10)], 4
        )


def test_quantized_ops_refuse_wrong_buffers():
    with pytest.raises(ValueError, match="out_data has dtype torch.float32; use torch.int8"):
        torch.ops.fsdp_compile.quantized_all_gather_copy_in([torch.ones(4)], [4], torch.empty(4), torch.empty(1), 4)
    with pytest.raises(ValueError, match=r"out_scales must be a contiguous float32 tensor of shape \(2,\)"):
        torch.ops.fsdp_compile.quantized_all_gather_copy_in(
            [torch.ones(4)], [8], torch.empty(8, dtype=torch.int8), torch.empty(1), 4
        )


# ---------------------------------------------------------------------------------------------
# sum_rows_copy_out
# ---------------------------------------------------------------------------------------------


def test_sum_rows_copy_out_writes_the_float32_sum_of_the_rows_into_the_shards():
    gen = torch.Generator().manual_seed(5)
    # Multiples of 1/8 below 32 in bf16: every partial sum is exact in float32, whatever the order.
    received = (torch.randint(-256, 256, (4, 8), generator=gen) / 8).to(torch.bfloat16)
    w_grad, b_grad = torch.full((2, 3), SENTINEL), torch.full((1,), SENTINEL)
    torch.ops.fsdp_compile.sum_rows_copy_out(received, [6, 2], [w_grad, b_grad], 4.0, False)
    expected = received.float().sum(dim=0) / 4.0
    assert torch.equal(w_grad, expected[:6].view(2, 3)) and torch.equal(b_grad, expected[6:7])


def test_sum_rows_copy_out_accumulates_in_float32_not_in_the_wire_dtype():
    # 256 + 1 + 1 + 1: bf16 sums would stay at 256 (257 rounds to even), float32 reaches 259.
    received = torch.tensor([[256.0], [1.0], [1.0], [1.0]], dtype=torch.bfloat16)
    grad = torch.full((1,), 1.0)
    torch.ops.fsdp_compile.sum_rows_copy_out(received, [1], [grad], 1.0, True)
    assert grad.item() == 260.0


def test_sum_rows_copy_out_sums_the_own_row_in_place_of_its_received_row():
    # Rank 1's own chunk, 1 + 2**-10, would round to 1 in bf16; given as own_row it is summed unrounded.
    received = torch.tensor([[256.0], [1.0], [1.0]], dtype=torch.bfloat16)
    grad = torch.empty(1)
    torch.ops.fsdp_compile.sum_rows_copy_out(received, [1], [grad], 1.0, False, torch.tensor([1 + 2**-10]), 1)
    assert grad.item() == 258 + 2**-10
    with pytest.raises(ValueError, match="own_rank 3 is not a row"):
        torch.ops.fsdp_compile.sum_rows_copy_out(received, [1], [grad], 1.0, False, torch.tensor([1.0]), 3)
    with pytest.raises(ValueError, match="own_row must be a contiguous float32 row of 1"):
        torch.ops.fsdp_compile.sum_rows_copy_out(received, [1], [grad], 1.0, False, torch.ones(2), 0)


def test_sum_rows_copy_out_refuses_bad_arguments():
    with pytest.raises(ValueError, match="non-zero"):
        torch.ops.fsdp_compile.sum_rows_copy_out(torch.ones(2, 2), [2], [torch.empty(2)], 0.0, False)
    with pytest.raises(ValueError, match="world >= 1"):
        torch.ops.fsdp_compile.sum_rows_copy_out(torch.ones(0, 2), [2], [torch.empty(2)], 1.0, False)


# ---------------------------------------------------------------------------------------------
# Triton kernels (interpreted) against the reference, bit for bit
# ---------------------------------------------------------------------------------------------

PARAM_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PARAM_IDS = ["fp32", "bf16", "fp16"]


def group(world: int, seed: int):
    """Shapes (an empty one, a 1-element one, one spanning several programs) and per-rank padded sizes."""
    shapes = [(0,), (1,), (3 + seed % 5, 7), (61, 37)]
    return shapes, [ShardLayout(shape, 0, world, 0).padded_shard_numel for shape in shapes]


@pytest.mark.parametrize("buffer_dtype", [torch.int8, torch.float8_e4m3fn, torch.uint8], ids=["int8", "e4m3", "e4m3-bytes"])
@pytest.mark.parametrize("src", PARAM_DTYPES, ids=PARAM_IDS)
@pytest.mark.parametrize("block", [128, 48])
def test_triton_quantized_copy_in_equals_reference(interpreted, block, src, buffer_dtype):
    world, rank = 2, 0
    shapes, padded = group(world, seed=block)
    gen = torch.Generator().manual_seed(block)
    shards = [
        ShardLayout(shape, 0, world, rank).shard_of(torch.randn(shape, generator=gen) * 3).contiguous().to(src)
        for shape in shapes
    ]
    shards[2].view(-1)[:2] = torch.tensor([0.0, -0.0])  # signed zeros among the data
    shards[3].view(-1)[:block] = 0.0  # and one all-zero block
    total = sum(quantized_reference.quantized_slot_numels(padded, block))
    ours_data, theirs_data = torch.full((total,), 99, dtype=torch.int8), torch.full((total,), 99, dtype=torch.int8)
    ours_scales, theirs_scales = torch.full((total // block,), SENTINEL), torch.full((total // block,), SENTINEL)
    interpreted.quantized_all_gather_copy_in(shards, padded, ours_data.view(buffer_dtype), ours_scales, block)
    quantized_reference.quantized_all_gather_copy_in(shards, padded, theirs_data.view(buffer_dtype), theirs_scales, block)
    assert_same_bits(ours_scales, theirs_scales)
    assert_same_bits(ours_data, theirs_data)


@pytest.mark.parametrize("buffer_dtype", [torch.int8, torch.float8_e4m3fn, torch.uint8], ids=["int8", "e4m3", "e4m3-bytes"])
@pytest.mark.parametrize("dst", PARAM_DTYPES, ids=PARAM_IDS)
def test_triton_quantized_copy_out_equals_reference(interpreted, dst, buffer_dtype):
    world, block = 3, 64
    shapes, padded = group(world, seed=1)
    gen = torch.Generator().manual_seed(6)
    total = sum(quantized_reference.quantized_slot_numels(padded, block))
    bytes_ = torch.randint(-128, 128, (world, total), dtype=torch.int8, generator=gen)
    if buffer_dtype != torch.int8:
        bytes_ = torch.where((bytes_ & 0x7F) == 0x7F, 0, bytes_)  # no NaN codes: our quantizer never writes them
    else:
        bytes_ = bytes_.clamp(-127, 127)
    scales = 10.0 ** torch.empty(world, total // block).uniform_(-3, 3, generator=gen)
    scales[0, 0] = 0.0
    ours, theirs = [torch.full(s, SENTINEL, dtype=dst) for s in shapes], [torch.full(s, SENTINEL, dtype=dst) for s in shapes]
    interpreted.quantized_all_gather_copy_out(bytes_.view(buffer_dtype), scales, padded, ours, block)
    quantized_reference.quantized_all_gather_copy_out(bytes_.view(buffer_dtype), scales, padded, theirs, block)
    for a, b in zip(ours, theirs):
        assert_same_bits(a, b)


@pytest.mark.parametrize("buffer_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "e4m3"])
def test_triton_quantized_copy_in_equals_reference_from_subnormal_to_huge_blocks(interpreted, buffer_dtype):
    """Blocks whose absmax ranges over float32's exponents: subnormal scales, scales that underflow to 0, near-max values."""
    gen = torch.Generator().manual_seed(8)
    magnitudes = torch.tensor([1e-44, 1e-41, 1e-39, 1e-37, 1e-20, 1.0, 1e20, 1e37, 3e38]).repeat_interleave(32)
    flat = (torch.rand(magnitudes.numel(), generator=gen) * 2 - 1) * magnitudes  # finite: |x| < 3e38
    ours_data, theirs_data = torch.empty(flat.numel(), dtype=buffer_dtype), torch.empty(flat.numel(), dtype=buffer_dtype)
    ours_scales, theirs_scales = torch.empty(flat.numel() // 32), torch.empty(flat.numel() // 32)
    interpreted.quantized_all_gather_copy_in([flat], [flat.numel()], ours_data, ours_scales, 32)
    quantized_reference.quantized_all_gather_copy_in([flat], [flat.numel()], theirs_data, theirs_scales, 32)
    assert ours_scales[0] == 0 and 0 < ours_scales[2] < torch.finfo(torch.float32).tiny, "no zero or subnormal scale"
    assert_same_bits(ours_scales, theirs_scales)
    assert_same_bits(ours_data.view(torch.int8), theirs_data.view(torch.int8))


def test_triton_e4m3_encoding_matches_torch_at_every_boundary(interpreted):
    """Every e4m3 value, the midpoints between neighbours (ties to even), one float32 ulp either side,
    subnormals and the 2**-10 tie with zero, both signs; scale 1 because each block starts with 448."""
    codes = torch.arange(0, 0x7F, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).float()
    midpoints = (codes[:-1] + codes[1:]) / 2
    bits = midpoints.view(torch.int32)
    values = torch.cat([codes, midpoints, (bits - 1).view(torch.float32), (bits + 1).view(torch.float32),
                        torch.tensor([2.0**-10, 2.0**-11, 2.0**-10 * 1.5, 1e-30, 447.9, 300.0])])
    values = torch.cat([values, -values])
    block = 64
    rows = values.split(block - 1)
    flat = torch.cat([torch.cat([torch.tensor([448.0]), row, torch.zeros(block - 1 - row.numel())]) for row in rows])
    ours, scales = torch.empty(flat.numel(), dtype=torch.uint8), torch.empty(flat.numel() // block)
    interpreted.quantized_all_gather_copy_in([flat], [flat.numel()], ours, scales, block)
    assert torch.equal(scales, torch.ones_like(scales))
    assert_same_bits(ours.view(torch.float8_e4m3fn), flat.to(torch.float8_e4m3fn))


def test_triton_e4m3_decoding_matches_torch_for_every_code(interpreted):
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(1, -1)  # NaN codes decode to some NaN, payload aside
    out = torch.full((codes.numel(),), SENTINEL)
    interpreted.quantized_all_gather_copy_out(codes, torch.ones(1, codes.numel() // 2), [codes.numel()], [out], 2)
    assert_same_bits(out, codes.view(torch.float8_e4m3fn).float().view(-1))


@pytest.mark.parametrize("own_rank", [None, 0, 2], ids=["all-received", "own-row-0", "own-row-2"])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("post_divide", [1.0, 3.0])
@pytest.mark.parametrize("src, dst", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)],
                         ids=["bf16-fp32", "bf16-bf16", "fp32-fp16"])
def test_triton_sum_rows_copy_out_equals_reference(interpreted, src, dst, post_divide, accumulate, own_rank):
    world = 4
    shapes, padded = group(world, seed=2)
    gen = torch.Generator().manual_seed(7)
    received = torch.randn(world, sum(padded), generator=gen).to(src)
    received[:, 0] = -0.0  # a lone -0.0 sum keeps its sign only if row 0 starts the sum
    own = {} if own_rank is None else {"own_row": torch.randn(sum(padded), generator=gen), "own_rank": own_rank}
    if own:
        own["own_row"][0] = -0.0
    sharded = [ShardLayout(shape, 0, world, world - 1).shard_of(torch.empty(shape)).shape for shape in shapes]
    if accumulate:
        ours = [torch.randn(s, generator=gen).to(dst) for s in sharded]
    else:
        ours = [torch.full(s, SENTINEL, dtype=dst) for s in sharded]
    theirs = [t.clone() for t in ours]
    interpreted.sum_rows_copy_out(received, padded, ours, post_divide, accumulate, **own)
    quantized_reference.sum_rows_copy_out(received, padded, theirs, post_divide, accumulate, **own)
    for a, b in zip(ours, theirs):
        assert_same_bits(a, b)


def test_triton_refuses_quantization_blocks_too_large_for_a_tile(interpreted):
    big = interpreted.MAX_QUANT_BLOCK * 2
    with pytest.raises(ValueError, match="blocks of at most"):
        interpreted.quantized_all_gather_copy_in([torch.ones(3)], [big], torch.empty(big, dtype=torch.int8), torch.empty(1), big)


def test_triton_quantizes_a_hundred_parameters_in_one_launch(interpreted, monkeypatch):
    launches = []
    kernel = interpreted._quantized_all_gather_copy_in_kernel

    class CountingKernel:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(interpreted, "_quantized_all_gather_copy_in_kernel", CountingKernel())
    shards = [torch.randn(index % 7) for index in range(100)]
    padded = [shard.numel() for shard in shards]
    total = sum(quantized_reference.quantized_slot_numels(padded, 8))
    interpreted.quantized_all_gather_copy_in(shards, padded, torch.empty(total, dtype=torch.int8), torch.empty(total // 8), 8)
    assert len(launches) == 1


def test_importing_kernels_registers_the_quantized_triton_kernels_for_cuda():
    pytest.importorskip("triton")
    from fsdp_compile.kernels import quantized_triton

    if quantized_triton.INTERPRETED:
        pytest.skip("interpreted kernels need CPU tensors and are not registered for CUDA")
    for name in ("quantized_all_gather_copy_in", "quantized_all_gather_copy_out", "sum_rows_copy_out"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fsdp_compile::{name}", "CUDA"), name
