"""The copy-in / copy-out kernels: reference layout, custom ops, and Triton (interpreted on CPU) against the reference.

The Triton kernels run under Triton's interpreter here (no GPU needed). Triton decides between
compiling and interpreting when ``@triton.jit`` decorates a function, i.e. when the module is
executed, and other test modules may already have imported ``fsdp_compile.kernels.triton_impl``
compiled-mode (``fsdp_compile.kernels`` imports it to register the CUDA kernels). So the
``interpreted`` fixture executes triton_impl.py a second time, as a separate module object
under a private name, with TRITON_INTERPRET=1 set just for that execution. That copy is
independent of test order and of the regular import, and registers nothing (registration is
an explicit call the copy never makes).
"""
from __future__ import annotations

import importlib.util
import math
import os
import random

import pytest
import torch

from fsdp_compile.kernels import reference
from fsdp_compile.runtime.layout import ShardLayout

# The interpreter evaluates NaN inputs with numpy, which warns; NaNs are part of the test data.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

WORD_DTYPE = {4: torch.int32, 2: torch.int16}
DTYPE_PAIRS = [
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
]
PAIR_IDS = ["fp32-bf16", "fp32-fp16", "fp32-fp32", "bf16-fp32"]
SENTINEL = -1234.5  # poison for outputs: an element the kernel forgets keeps it and fails the compare


@pytest.fixture(scope="module")
def interpreted():
    """triton_impl.py executed afresh with TRITON_INTERPRET=1, so its kernels run on CPU tensors.

    Only the Triton tests take this fixture: without Triton they are skipped, the rest still run."""
    pytest.importorskip("triton")
    path = os.path.join(os.path.dirname(reference.__file__), "triton_impl.py")
    spec = importlib.util.spec_from_file_location("_fsdp_compile_triton_impl_interpreted", path)
    module = importlib.util.module_from_spec(spec)
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec.loader.exec_module(module)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    assert module.INTERPRETED, "TRITON_INTERPRET=1 did not reach triton.jit; the kernels would need a GPU"
    return module


# ---------------------------------------------------------------------------------------------
# Helpers: FSDP-style groups and value generators
# ---------------------------------------------------------------------------------------------


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, nan_payloads: bool = True) -> None:
    """Bitwise equality (so -0.0 vs 0.0 and inf count); with nan_payloads=False any NaN matches any NaN.

    Converting a NaN to bf16/fp16 has no single answer to match: torch on CPU writes 0xFFFF from
    its vector path and 0x7FC0 from its scalar tail, CUDA writes 0x7FFF. Everything else is exact.
    """
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    words = WORD_DTYPE[actual.element_size()]
    actual_bits, expected_bits = actual.reshape(-1).view(words), expected.reshape(-1).view(words)
    if not nan_payloads:
        nan = expected.reshape(-1).isnan()
        assert torch.equal(actual.reshape(-1).isnan(), nan), "NaN in different places"
        actual_bits, expected_bits = actual_bits[~nan], expected_bits[~nan]
    mismatch = (actual_bits != expected_bits).nonzero().reshape(-1)
    if mismatch.numel():
        index = mismatch[0].item()
        raise AssertionError(
            f"{mismatch.numel()} of {actual_bits.numel()} elements differ; first at {index}: "
            f"got {actual_bits[index].item():#x}, expected {expected_bits[index].item():#x}"
        )


def interesting_values(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns (all of NaN, inf, subnormals, -0.0 appear), biased toward rounding ties.

    For float32 sources a third of the values sit exactly halfway between two bf16 numbers,
    a third halfway between two fp16 numbers with exponents in and around fp16's range
    (subnormals, normals, the overflow threshold), the rest are uniform random bits.
    """
    if dtype != torch.float32:
        return torch.randint(-(2**15), 2**15, (numel,), dtype=torch.int16, generator=gen).view(dtype)
    bits = torch.randint(-(2**31), 2**31, (numel,), dtype=torch.int64, generator=gen)
    bf16_ties = (bits & ~0xFFFF) | 0x8000
    exponent = torch.randint(100, 145, (numel,), generator=gen)
    dropped = torch.clamp(126 - exponent, 13, 24)  # fp16 drops 13 significand bits, more for subnormals
    kept = bits & (0x80000000 | ((0x7FFFFF >> dropped) << dropped))
    tie_bit = torch.where(dropped < 24, 1 << (dropped - 1), 0)  # at 24 the tie bit is the implicit one
    fp16_ties = kept | (exponent << 23) | tie_bit
    choice = torch.arange(numel) % 3
    bits = torch.where(choice == 0, bf16_ties, torch.where(choice == 1, fp16_ties, bits))
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    return bits.to(torch.int32).view(torch.float32)


def random_shapes(count: int, rng: random.Random) -> list[tuple[int, ...]]:
    """Parameter shapes with empty ones, 1-element ones, and one spanning several kernel blocks."""
    shapes = []
    for index in range(count):
        kind = rng.random()
        if kind < 0.1:
            shapes.append((0,) if rng.random() < 0.5 else (3, 0))
        elif kind < 0.25:
            shapes.append((1,))
        elif kind < 0.6:
            shapes.append((rng.randint(1, 40),))
        else:
            shapes.append((rng.randint(1, 13), rng.randint(1, 9)))
    shapes[count // 2] = (5, 1031)  # 5155 elements: several 2048-element blocks, odd row length
    return shapes


def padded_numel(shape: tuple[int, ...], world: int) -> int:
    return ShardLayout(shape, 0, world, 0).padded_shard_numel


def shard(unsharded: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank's rows of dim 0, as the runtime splits them (the last ranks may get fewer or none)."""
    return ShardLayout(tuple(unsharded.shape), 0, world, rank).shard_of(unsharded).contiguous()


# (src, dst, parameter count, world sizes). The interpreter costs milliseconds per program and a
# [world, total] kernel runs one program per (block, rank), every parameter at least one block, so
# every dtype pair and world size runs on 1-parameter groups, and a many-parameter group (empty,
# 1-element and multi-block parameters: a test checks) on the two narrowing pairs, each at one
# world size. Interpreted, the group has 24 parameters: a quarter of the programs of 100 (their
# cases took 38 of this file's 50 CPU s), the same kinds of parameters and boundaries between them;
# compiled on a GPU it has 100 (test_cuda.py).
INTERPRETED_GROUP = 24


def kernel_cases(many: int) -> list:
    """The cases above, with a ``many``-parameter group."""
    cases = [pytest.param(src, dst, 1, range(1, 9), id=f"1param-{name}") for (src, dst), name in zip(DTYPE_PAIRS, PAIR_IDS)]
    cases.append(pytest.param(torch.float32, torch.bfloat16, many, [3], id=f"{many}params-fp32-bf16"))
    cases.append(pytest.param(torch.float32, torch.float16, many, [4], id=f"{many}params-fp32-fp16"))
    return cases


CASES = kernel_cases(INTERPRETED_GROUP)
MANY = f"{INTERPRETED_GROUP}params"  # the id prefix of CASES' many-parameter groups


def with_scalings(cases: list, scalings_of_one_parameter: list[tuple], scaling_of_many: dict[str, tuple]) -> list:
    """``cases`` crossed with a reduce-scatter kernel's divisor (and accumulate) settings: every setting
    on the 1-parameter groups, at every world size; one setting per many-parameter group (each setting
    on one narrowing pair), whose interpreted launches cost seconds each and whose extra coverage is
    the multi-parameter layout, not the arithmetic."""
    crossed = []
    for case in cases:
        case_id = case.id
        settings = [scaling_of_many[case_id]] if case_id in scaling_of_many else scalings_of_one_parameter
        for setting in settings:
            crossed.append(pytest.param(*case.values, *setting, id="-".join([case_id, *map(str, setting)])))
    return crossed


def make_group(count: int, world: int, seed: int):
    """Shapes and padded per-rank sizes; a 1-parameter group alternates a (1,) parameter and a larger one."""
    rng = random.Random(seed)
    if count == 1:
        shapes = [(1,)] if seed % 2 else [(rng.randint(1, 3 * world), 97)]
    else:
        shapes = random_shapes(count, rng)
    return shapes, [padded_numel(shape, world) for shape in shapes]


def poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, SENTINEL, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# The reference against a layout worked out by hand (2 parameters, world 2)
# ---------------------------------------------------------------------------------------------
#
# p0 has shape (3, 2): ceil(3 / 2) = 2 rows per rank, padded 4; p1 has shape (1,): padded 1.
#   rank 0's row: | p0 rows 0-1: 0 1 2 3 | p1: 6 |
#   rank 1's row: | p0 row 2:   4 5 _ _ | p1: _ |      (_ = padding, zero)

HAND_PADDED = [4, 1]
HAND_GATHERED = torch.tensor([[0.0, 1, 2, 3, 6], [4, 5, 0, 0, 0]])


def test_reference_all_gather_copy_in_matches_hand_layout():
    out = poisoned((5,), torch.float32)
    reference.all_gather_copy_in([torch.tensor([4.0, 5.0]), torch.empty(0)], HAND_PADDED, out)
    assert torch.equal(out, HAND_GATHERED[1])


def test_reference_all_gather_copy_out_matches_hand_layout():
    p0, p1 = poisoned((3, 2), torch.float32), poisoned((1,), torch.float32)
    reference.all_gather_copy_out(HAND_GATHERED, HAND_PADDED, [p0, p1])
    assert torch.equal(p0, torch.arange(6.0).view(3, 2)) and torch.equal(p1, torch.tensor([6.0]))


def test_reference_reduce_scatter_copy_in_matches_hand_layout():
    out = poisoned((2, 5), torch.float32)
    reference.reduce_scatter_copy_in([torch.arange(6.0).view(3, 2), torch.tensor([6.0])], HAND_PADDED, out, 2.0)
    assert torch.equal(out, HAND_GATHERED / 2)


def test_reference_reduce_scatter_copy_out_matches_hand_layout():
    p0, p1 = torch.ones(1, 2), torch.ones(0)
    reference.reduce_scatter_copy_out(HAND_GATHERED[1], HAND_PADDED, [p0, p1], 4.0, accumulate=True)
    assert torch.equal(p0, torch.tensor([[2.0, 2.25]])) and p1.numel() == 0


# ---------------------------------------------------------------------------------------------
# The custom ops against the shard layout: a round trip through every rank gives back the input
# ---------------------------------------------------------------------------------------------


def test_custom_ops_round_trip_every_rank_through_the_shard_layout():
    gen = torch.Generator().manual_seed(0)
    world = 3
    shapes, padded = make_group(100, world, seed=1)
    unsharded = [torch.randn(shape, generator=gen) for shape in shapes]

    # All-gather: each rank copies its shards into its row; the copy-out rebuilds every parameter.
    gathered = poisoned((world, sum(padded)), torch.float32)
    for rank in range(world):
        torch.ops.fsdp_compile.all_gather_copy_in([shard(t, rank, world) for t in unsharded], padded, gathered[rank])
    rebuilt = [poisoned(shape, torch.float32) for shape in shapes]
    torch.ops.fsdp_compile.all_gather_copy_out(gathered, padded, rebuilt)
    for a, b in zip(rebuilt, unsharded):
        assert_same_bits(a, b)

    # Reduce-scatter: the copy-in lays gradients out so that rank r's row holds exactly its shard
    # (divided), and the copy-out of that row writes it back (multiplied by a power of two: exact).
    rows = poisoned((world, sum(padded)), torch.float32)
    torch.ops.fsdp_compile.reduce_scatter_copy_in(unsharded, padded, rows, 4.0)
    for rank in range(world):
        outs = [poisoned(shard(t, rank, world).shape, torch.float32) for t in unsharded]
        torch.ops.fsdp_compile.reduce_scatter_copy_out(rows[rank], padded, outs, 0.25, False)
        for out, t in zip(outs, unsharded):
            assert_same_bits(out, shard(t, rank, world))


def test_functional_ops_of_compiled_graphs_equal_the_ops_writing_into_buffers():
    """The bucket pass's copy-in / copy-out ops return what the mutating ops write (bf16 cast and
    padding included), and their fake implementations give the shapes and dtypes they return."""
    gen = torch.Generator().manual_seed(2)
    world = 3
    shapes, padded = make_group(12, world, seed=3)
    unsharded = [torch.randn(shape, generator=gen) for shape in shapes]
    rows = []
    for rank in range(world):
        shards = [shard(t, rank, world).contiguous() for t in unsharded]
        written = poisoned((sum(padded),), torch.bfloat16)
        torch.ops.fsdp_compile.all_gather_copy_in(shards, padded, written)
        returned = torch.ops.fsdp_compile.all_gather_copy_in_functional(shards, padded, torch.bfloat16)
        assert_same_bits(returned, written)
        rows.append(returned)
    gathered = torch.stack(rows)
    sizes, ndims = [size for shape in shapes for size in shape], [len(shape) for shape in shapes]
    returned = torch.ops.fsdp_compile.all_gather_copy_out_functional(gathered, padded, sizes, ndims)
    written = [poisoned(shape, torch.bfloat16) for shape in shapes]
    torch.ops.fsdp_compile.all_gather_copy_out(gathered, padded, written)
    assert [tuple(t.shape) for t in returned] == [tuple(shape) for shape in shapes]
    for a, b, original in zip(returned, written, unsharded):
        assert_same_bits(a, b)
        assert_same_bits(a, original.to(torch.bfloat16))
    with torch._subclasses.FakeTensorMode() as fake_mode:
        fake = fake_mode.from_tensor(gathered)
        outs = torch.ops.fsdp_compile.all_gather_copy_out_functional(fake, padded, sizes, ndims)
        assert [(tuple(t.shape), t.dtype) for t in outs] == [(tuple(s), torch.bfloat16) for s in shapes]
        flat = torch.ops.fsdp_compile.all_gather_copy_in_functional([fake_mode.from_tensor(unsharded[0])], [padded[0] * world], torch.float16)
        assert tuple(flat.shape) == (padded[0] * world,) and flat.dtype == torch.float16


def test_custom_ops_refuse_a_buffer_of_the_wrong_size_before_writing():
    shards = [torch.ones(2, 3)]
    with pytest.raises(ValueError, match="out has 5 elements but the padded shards need 6"):
        torch.ops.fsdp_compile.all_gather_copy_in(shards, [6], torch.zeros(5))
    with pytest.raises(ValueError, match="more than its padded size"):
        torch.ops.fsdp_compile.all_gather_copy_in(shards, [4], torch.zeros(4))


# ---------------------------------------------------------------------------------------------
# Triton kernels (interpreted) against the reference, bit for bit
# ---------------------------------------------------------------------------------------------


def test_interpreted_many_parameter_groups_hold_every_kind_of_parameter():
    """CASES' many-parameter groups, as the four copy tests below draw them (seed world + 0..3), hold
    an empty, a 1-element and a multi-block parameter: the coverage their size is chosen for."""
    groups = [(case.values[2], world) for case in CASES if case.values[2] > 1 for world in case.values[3]]
    assert groups
    for count, world in groups:
        for seed in range(world, world + 4):
            shapes, _ = make_group(count, world, seed)
            kinds = {"empty": any(0 in shape for shape in shapes), "1-element": (1,) in shapes, "multi-block": (5, 1031) in shapes}
            assert all(kinds.values()), f"seed {seed}: {count} parameters without every kind: {kinds}"


@pytest.mark.parametrize("src, dst, count, worlds", CASES)
def test_triton_all_gather_copy_in_equals_reference(interpreted, src, dst, count, worlds):
    for world in worlds:
        gen = torch.Generator().manual_seed(world)
        shapes, padded = make_group(count, world, seed=world)
        for rank in sorted({0, world - 1}):
            shards = [shard(interesting_values(math.prod(s), src, gen).view(s), rank, world) for s in shapes]
            ours, theirs = poisoned((sum(padded),), dst), poisoned((sum(padded),), dst)
            interpreted.all_gather_copy_in(shards, padded, ours)
            reference.all_gather_copy_in(shards, padded, theirs)
            assert_same_bits(ours, theirs, nan_payloads=src == dst)


@pytest.mark.parametrize("src, dst, count, worlds", CASES)
def test_triton_all_gather_copy_out_equals_reference(interpreted, src, dst, count, worlds):
    for world in worlds:
        gen = torch.Generator().manual_seed(world)
        shapes, padded = make_group(count, world, seed=world + 1)
        gathered = interesting_values(world * sum(padded), src, gen).view(world, sum(padded))
        ours, theirs = [poisoned(s, dst) for s in shapes], [poisoned(s, dst) for s in shapes]
        interpreted.all_gather_copy_out(gathered, padded, ours)
        reference.all_gather_copy_out(gathered, padded, theirs)
        for a, b in zip(ours, theirs):
            assert_same_bits(a, b, nan_payloads=src == dst)


@pytest.mark.parametrize(
    "src, dst, count, worlds, pre_divide",
    with_scalings(CASES, [(1.0,), (3.0,)], {f"{MANY}-fp32-bf16": (1.0,), f"{MANY}-fp32-fp16": (3.0,)}),
)
def test_triton_reduce_scatter_copy_in_equals_reference(interpreted, src, dst, count, worlds, pre_divide):
    for world in worlds:
        gen = torch.Generator().manual_seed(world)
        shapes, padded = make_group(count, world, seed=world + 2)
        grads = [interesting_values(math.prod(s), src, gen).view(s) for s in shapes]
        ours, theirs = poisoned((world, sum(padded)), dst), poisoned((world, sum(padded)), dst)
        interpreted.reduce_scatter_copy_in(grads, padded, ours, pre_divide)
        reference.reduce_scatter_copy_in(grads, padded, theirs, pre_divide)
        assert_same_bits(ours, theirs, nan_payloads=src == dst and pre_divide == 1.0)


@pytest.mark.parametrize(
    "src, dst, count, worlds, post_divide, accumulate",
    with_scalings(
        CASES, [(1.0, False), (1.0, True), (3.0, False), (3.0, True)],
        {f"{MANY}-fp32-bf16": (1.0, True), f"{MANY}-fp32-fp16": (3.0, False)},
    ),
)
def test_triton_reduce_scatter_copy_out_equals_reference(interpreted, src, dst, count, worlds, post_divide, accumulate):
    for world in worlds:
        gen = torch.Generator().manual_seed(world)
        shapes, padded = make_group(count, world, seed=world + 3)
        rank = world - 1
        reduced = interesting_values(sum(padded), src, gen)
        sharded_shapes = [shard(torch.empty(s), rank, world).shape for s in shapes]
        if accumulate:
            ours = [torch.randn(s, generator=gen).to(dst) for s in sharded_shapes]
        else:
            ours = [poisoned(s, dst) for s in sharded_shapes]
        theirs = [t.clone() for t in ours]
        interpreted.reduce_scatter_copy_out(reduced, padded, ours, post_divide, accumulate)
        reference.reduce_scatter_copy_out(reduced, padded, theirs, post_divide, accumulate)
        exact_nans = src == dst and post_divide == 1.0 and not accumulate
        for a, b in zip(ours, theirs):
            assert_same_bits(a, b, nan_payloads=exact_nans)


class RecordingKernel:
    """Stands in for a Triton kernel: records each launch's dtype codes, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.codes = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.codes.append((kwargs["SRC"], kwargs["DST"]))
            return self.kernel[grid](*args, **kwargs)

        return launch


# Even shapes (every numel and padded size even): the copies move element pairs as float32 words;
# one parameter of odd numel (3 x 5: 15 elements, a shard of 5) keeps the whole group on 2-byte words.
PAIRED_GROUPS = [pytest.param([(6, 4), (4,), (4, 2050)], 0, id="even"), pytest.param([(6, 4), (3, 5)], 1, id="odd")]


@pytest.mark.parametrize("shapes, expected_code", PAIRED_GROUPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_triton_same_dtype_two_byte_copies_move_element_pairs_as_words(interpreted, monkeypatch, shapes, expected_code, dtype):
    """[Note: 2-byte elements moved in pairs]: a bit copy of bf16 / fp16 runs the float32 kernel
    (dtype code 0) over words of two elements when every boundary is even, else 2-byte words; both
    equal the reference bit for bit, NaN payloads included. A copy that divides keeps 2-byte words."""
    world, rank = 2, 1
    gen = torch.Generator().manual_seed(7)
    padded = [padded_numel(shape, world) for shape in shapes]
    kernels = {}
    for name in ("all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in", "reduce_scatter_copy_out"):
        kernels[name] = RecordingKernel(getattr(interpreted, f"_{name}_kernel"))
        monkeypatch.setattr(interpreted, f"_{name}_kernel", kernels[name])
    unsharded = [interesting_values(math.prod(shape), dtype, gen).view(shape) for shape in shapes]
    shards = [shard(tensor, rank, world) for tensor in unsharded]

    row_ours, row_theirs = poisoned((sum(padded),), dtype), poisoned((sum(padded),), dtype)
    interpreted.all_gather_copy_in(shards, padded, row_ours)
    reference.all_gather_copy_in(shards, padded, row_theirs)
    assert_same_bits(row_ours, row_theirs)

    gathered = interesting_values(world * sum(padded), dtype, gen).view(world, sum(padded))
    outs_ours, outs_theirs = [poisoned(s, dtype) for s in shapes], [poisoned(s, dtype) for s in shapes]
    interpreted.all_gather_copy_out(gathered, padded, outs_ours)
    reference.all_gather_copy_out(gathered, padded, outs_theirs)
    for ours, theirs in zip(outs_ours, outs_theirs):
        assert_same_bits(ours, theirs)

    for pre_divide in (1.0, 2.0):
        buffer_ours, buffer_theirs = poisoned((world, sum(padded)), dtype), poisoned((world, sum(padded)), dtype)
        interpreted.reduce_scatter_copy_in(unsharded, padded, buffer_ours, pre_divide)
        reference.reduce_scatter_copy_in(unsharded, padded, buffer_theirs, pre_divide)
        assert_same_bits(buffer_ours, buffer_theirs, nan_payloads=pre_divide == 1.0)

    reduced = interesting_values(sum(padded), dtype, gen)
    grads_ours = [poisoned(s.shape, dtype) for s in shards]
    grads_theirs = [g.clone() for g in grads_ours]
    interpreted.reduce_scatter_copy_out(reduced, padded, grads_ours, 1.0, False)
    reference.reduce_scatter_copy_out(reduced, padded, grads_theirs, 1.0, False)
    for ours, theirs in zip(grads_ours, grads_theirs):
        assert_same_bits(ours, theirs)

    code = 2 if dtype == torch.float16 else 1
    expected = (expected_code, expected_code) if expected_code == 0 else (code, code)
    assert kernels["all_gather_copy_in"].codes == [expected]
    assert kernels["all_gather_copy_out"].codes == [expected]
    assert kernels["reduce_scatter_copy_in"].codes == [expected, (code, code)]  # a divide needs the elements
    assert kernels["reduce_scatter_copy_out"].codes == [expected]


def test_triton_divides_by_negative_factor_like_reference(interpreted):
    """Padding is divided too: 0 / -2 is -0.0 in the reference, so the kernel must not skip it."""
    grads = [torch.randn(5), torch.randn(1, 3)]
    padded = [padded_numel((5,), 4), padded_numel((1, 3), 4)]
    ours, theirs = poisoned((4, sum(padded)), torch.bfloat16), poisoned((4, sum(padded)), torch.bfloat16)
    interpreted.reduce_scatter_copy_in(grads, padded, ours, -2.0)
    reference.reduce_scatter_copy_in(grads, padded, theirs, -2.0)
    assert_same_bits(ours, theirs)


@pytest.mark.parametrize("dst", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_triton_narrowing_rounds_every_boundary_case_like_torch(interpreted, dst):
    """Ties to even, carries into the exponent, overflow to inf, fp16 subnormals and underflow, signed zeros."""
    info = torch.finfo(dst)
    ulp_bits = 16 if dst == torch.bfloat16 else 13
    values = [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float(info.max), -float(info.max),
              float(info.tiny), float(info.smallest_normal) / 2, float(info.tiny) * info.eps, 2.0**-25, 2.0**-26,
              65504.0, 65519.0, 65520.0, 65536.0, 3.0e38, 1e-45]
    base = torch.tensor(values, dtype=torch.float32).view(torch.int32)
    # Exactly halfway (even and odd neighbours), just below and just above halfway.
    half = 1 << (ulp_bits - 1)
    odd = torch.tensor([0x3F800000 | (1 << ulp_bits), 0x477FE000, 0x7F7F0000, 0x00010000], dtype=torch.int32)
    neighbours = torch.cat([odd, base & ~((1 << ulp_bits) - 1)])
    ties = torch.cat([neighbours | half, neighbours | (half - 1), neighbours | (half + 1)])
    source = torch.cat([base, ties, -ties.view(torch.float32).abs().view(torch.int32)]).view(torch.float32)
    ours, theirs = poisoned(source.shape, dst), poisoned(source.shape, dst)
    interpreted.all_gather_copy_in([source], [source.numel()], ours)
    reference.all_gather_copy_in([source], [source.numel()], theirs)
    assert_same_bits(ours, theirs, nan_payloads=False)


def test_triton_cuda_divide_mode_multiplies_by_float32_reciprocal(interpreted):
    """On CUDA, torch computes ``t / d`` for a Python scalar d as ``t * float32(1 / d)`` (BinaryDivTrueKernel.cu),
    so the kernels do too there. Only the arithmetic is checked here, on CPU, against that formula."""
    gen = torch.Generator().manual_seed(7)
    reduced = interesting_values(300, torch.float32, gen)
    out = poisoned((300,), torch.float32)  # in float32 about a third of the quotients differ from t / 3
    divisor, reciprocal = interpreted._divisor_and_reciprocal(3.0)
    metadata = interpreted._metadata([out], [300], [1], out.device)
    interpreted._reduce_scatter_copy_out_kernel[(1,)](
        metadata, 1, reduced.view(torch.int32), divisor, reciprocal,
        SRC=0, DST=0, DIVIDE=True, BY_RECIPROCAL=True, ACCUMULATE=False, BLOCK=interpreted.BLOCK_SIZE,
    )
    assert reciprocal == float(torch.tensor(1.0) / torch.tensor(3.0))
    assert_same_bits(out, reduced * reciprocal, nan_payloads=False)
    assert not torch.equal(out.view(torch.int32), (reduced / 3.0).view(torch.int32))


def test_triton_launches_one_kernel_for_a_hundred_parameters(interpreted, monkeypatch):
    launches = []

    class CountingKernel:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launches.append(grid)
            return self.kernel[grid]

    name = "_reduce_scatter_copy_in_kernel"
    monkeypatch.setattr(interpreted, name, CountingKernel(getattr(interpreted, name)))
    shapes, padded = make_group(100, 2, seed=5)
    grads = [torch.randn(s) for s in shapes]
    interpreted.reduce_scatter_copy_in(grads, padded, torch.empty(2, sum(padded)), 2.0)
    assert len(launches) == 1


def test_triton_group_of_only_empty_parameters_is_a_no_op(interpreted):
    out = torch.empty(0)
    interpreted.all_gather_copy_in([torch.empty(0), torch.empty(0, 3)], [0, 0], out)
    interpreted.reduce_scatter_copy_out(torch.empty(0), [0], [torch.empty(0)], 2.0, True)


# ---------------------------------------------------------------------------------------------
# Bad arguments fail with a message, before anything is written
# ---------------------------------------------------------------------------------------------


def test_triton_rejects_padded_numels_of_wrong_length(interpreted):
    with pytest.raises(ValueError, match="padded_numels"):
        interpreted.all_gather_copy_in([torch.ones(2), torch.ones(1)], [2], torch.empty(2))


def test_triton_rejects_shard_larger_than_padded_size(interpreted):
    with pytest.raises(ValueError, match="more than its padded size"):
        interpreted.all_gather_copy_in([torch.ones(3)], [2], torch.empty(2))


def test_triton_rejects_buffer_of_wrong_size(interpreted):
    with pytest.raises(ValueError, match="columns but padded_numels add up to"):
        interpreted.all_gather_copy_out(torch.ones(2, 5), [2], [torch.empty(4)])


def test_triton_rejects_non_contiguous_tensors(interpreted):
    grad = torch.ones(4, 3).t()
    with pytest.raises(ValueError, match="contiguous"):
        interpreted.reduce_scatter_copy_in([grad], [6], torch.empty(2, 6), 1.0)


def test_triton_rejects_integer_tensors(interpreted):
    with pytest.raises(ValueError, match="floating-point"):
        interpreted.reduce_scatter_copy_out(torch.ones(4, dtype=torch.int32), [4], [torch.empty(4)], 1.0, False)


def test_triton_rejects_mixed_dtypes_within_a_role(interpreted):
    with pytest.raises(ValueError, match="one dtype"):
        interpreted.all_gather_copy_in([torch.ones(2), torch.ones(2, dtype=torch.bfloat16)], [2, 2], torch.empty(4))


def test_triton_rejects_float64(interpreted):
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        interpreted.all_gather_copy_out(torch.ones(1, 2, dtype=torch.float64), [2], [torch.empty(2)])


def test_compiled_triton_rejects_cpu_tensors():
    pytest.importorskip("triton")
    from fsdp_compile.kernels import triton_impl

    if triton_impl.INTERPRETED:
        pytest.skip("the whole run is interpreted (TRITON_INTERPRET=1 set globally)")
    with pytest.raises(ValueError, match="CUDA tensors"):
        triton_impl.all_gather_copy_in([torch.ones(2)], [2], torch.empty(2))


def test_importing_kernels_registers_triton_as_the_cuda_implementation():
    pytest.importorskip("triton")
    import fsdp_compile.kernels  # noqa: F401
    from fsdp_compile.kernels import triton_impl

    if triton_impl.INTERPRETED:
        pytest.skip("interpreted kernels need CPU tensors and are not registered for CUDA")
    for name in ("all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in", "reduce_scatter_copy_out"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fsdp_compile::{name}", "CUDA"), name


def test_custom_op_rejects_bad_arguments_on_cpu():
    with pytest.raises(ValueError, match="non-zero"):
        torch.ops.fsdp_compile.reduce_scatter_copy_out(torch.ones(2), [2], [torch.empty(2)], 0.0, False)
