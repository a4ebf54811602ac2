"""CommPolicy: what goes on the wire, tested by the bytes it moves and the numbers it gives.

Block-quantized all-gathers (int8, fp8 e4m3) reproduce the kernels' quantize / dequantize exactly,
eager and compiled; the bf16 gradient wire sums in float32 (exactly the float32 sum of the other
ranks' rounded contributions and a rank's own unrounded one) and loses less than a bf16
reduce-scatter (nothing at all on bf16 gradients); bad policies fail at ``fully_shard``.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_compile
from fsdp_compile import CommPolicy, MixedPrecisionPolicy, fully_shard
from fsdp_compile.kernels import quantized_reference
from fsdp_compile.models import TransformerConfig, next_token_loss
from fsdp_testing import SMALL, build_reference, count_process_group_calls, global_batches, local_part, shard_model, sharded_copy

# Untied: under torch.compile a tied weight's two reads each cross the wire (rounded once per read).
UNTIED = dataclasses.replace(SMALL, tie_embeddings=False)


class _Echo(nn.Module):
    """Returns its (unsharded) weight: what the all-gather delivered."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(37, 24, generator=torch.Generator().manual_seed(0)) * 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x


def _expected_unsharded(full: torch.Tensor, world: int, wire: torch.dtype, block: int) -> torch.Tensor:
    """Each rank's padded chunk, zero-filled to whole blocks, quantized and dequantized; then joined."""
    chunk = -(-full.shape[0] // world)
    rows = []
    for rank in range(world):
        piece = full[rank * chunk : (rank + 1) * chunk]
        padded = torch.zeros(chunk, *full.shape[1:])
        padded[: piece.shape[0]] = piece
        flat = padded.reshape(-1)
        slot = quantized_reference.quantized_slot_numels([flat.numel()], block)[0]
        data, scales = quantized_reference.quantize_blocks(torch.nn.functional.pad(flat, [0, slot - flat.numel()]), block, wire)
        rows.append(quantized_reference.dequantize_blocks(data, scales, block, torch.float32)[: flat.numel()].view(chunk, -1))
    return torch.cat(rows)[: full.shape[0]]


def _quantized_all_gather() -> dict:
    out: dict = {}
    world = dist.get_world_size()
    for wire in (torch.int8, torch.float8_e4m3fn):
        policy = CommPolicy(all_gather_dtype=wire, block_size=128)
        reference = _Echo()
        expected = _expected_unsharded(reference.weight.detach(), world, wire, 128)
        for mode in ("eager", "compiled"):
            torch._dynamo.reset()
            model = _Echo()
            fully_shard(model, comm_policy=policy)
            runner = torch.compile(model, backend="fsdp_aot_eager") if mode == "compiled" else model
            with fsdp_compile.record_collectives() as log:
                seen = runner(torch.ones(37, 24)).detach()
            out[f"{wire}_{mode}_gap"] = (seen - expected).abs().max().item()
            if mode == "eager":
                out[f"{wire}_bytes"] = sorted((str(r.dtype), r.nbytes) for r in log)
        # The documented bound: int8 within half a block's scale of the full-precision weight.
        full = reference.weight.detach()
        out[f"{wire}_error"] = (expected - full).abs().max().item()
        out[f"{wire}_absmax"] = full.abs().max().item()
    return out


def test_quantized_all_gather_delivers_the_kernels_dequantized_weights_eager_and_compiled(dist):
    result = dist.run(2, _quantized_all_gather)[0]
    for wire, name in ((torch.int8, "torch.int8"), (torch.float8_e4m3fn, "torch.float8_e4m3fn")):
        assert result[f"{wire}_eager_gap"] == 0.0 and result[f"{wire}_compiled_gap"] == 0.0, result
        # 19 of 37 rows per rank, 24 wide: 456 elements in a slot of 512 (4 blocks of 128), and 4 scales.
        assert result[f"{wire}_bytes"] == sorted([(name, 512), ("torch.float32", 16)]), result[f"{wire}_bytes"]
    assert result["torch.int8_error"] <= result["torch.int8_absmax"] / 127 / 2
    assert 0 < result["torch.float8_e4m3fn_error"] <= result["torch.float8_e4m3fn_absmax"] * 2**-4


class _Weighted(nn.Module):
    """``sum(weight * c)``: the gradient of ``weight`` is exactly the rank's ``c``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(8192))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.weight * c).sum()


def _contributions(world: int) -> list[torch.Tensor]:
    """Each rank's gradient for ``_Weighted``: of different magnitudes, so their sum rounds."""
    return [torch.randn(8192, generator=torch.Generator().manual_seed(r)) * (1 + r) for r in range(world)]


def _reduced(contribution: torch.Tensor, backend: str | None = None, **fully_shard_kwargs) -> tuple[torch.Tensor, list]:
    """The full reduced gradient of ``_Weighted`` after this rank contributed ``contribution``, and
    the reduce-scatters' records; compiled with ``backend`` when given."""
    torch._dynamo.reset()
    model = _Weighted()
    fully_shard(model, **fully_shard_kwargs)
    runner = model if backend is None else torch.compile(model, backend=backend)
    with fsdp_compile.record_collectives() as log:
        runner(contribution).backward()
    return model.weight.grad.full_tensor(), [r for r in log if r.kind == "reduce_scatter"]


def _own_chunk_reference(contributions: list[torch.Tensor], world: int) -> torch.Tensor:
    """The wire's result for one parameter: rank k sums dim-0 chunk k, its own contribution
    unrounded and the others as bf16, in rank order, then divides by the world size."""
    chunks = [c.tensor_split([(k + 1) * -(-c.shape[0] // world) for k in range(world - 1)]) for c in contributions]
    return torch.cat([
        sum(chunk[k] if r == k else chunk[k].bfloat16().float() for r, chunk in enumerate(chunks)) / world
        for k in range(world)
    ])


def _gradient_wire() -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    contributions = _contributions(world)
    exact = sum(c.double() for c in contributions) / world
    # See [Note: the gradient wire's own chunk].
    rounded_sum = _own_chunk_reference(contributions, world)
    out = {}
    for name, kwargs in (
        ("wire", {"comm_policy": CommPolicy(reduce_wire_dtype=torch.bfloat16)}),
        ("bf16_reduce_scatter", {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)}),
    ):
        grad, reduce_scatters = _reduced(contributions[rank], **kwargs)
        out[name] = (grad.double() - exact).abs().max().item()
        out[f"{name}_vs_rounded_sum"] = (grad - rounded_sum).abs().max().item()
        out[f"{name}_bytes"] = [(r.kind, str(r.dtype), r.nbytes) for r in reduce_scatters]
    if world == 2:  # the compiled rank selection (first and last row) once: a compile at 4 ranks costs 6 s
        compiled, _ = _reduced(contributions[rank], "fsdp_inductor", comm_policy=CommPolicy(reduce_wire_dtype=torch.bfloat16))
        out["compiled_wire_vs_rounded_sum"] = (compiled - rounded_sum).abs().max().item()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_wire_is_the_float32_sum_of_the_wire_rounded_gradients_and_beats_a_bf16_reduce_scatter(dist, world):
    result = dist.run(world, _gradient_wire)[0]
    assert result["wire_vs_rounded_sum"] == 0.0, result
    if world == 2:  # compiled there only (see _gradient_wire)
        assert result["compiled_wire_vs_rounded_sum"] == 0.0, result
    assert result["wire_bytes"] == [("reduce_scatter", "torch.bfloat16", 8192 * 2)]
    # The bf16 reduce-scatter rounds every contribution and then its sums; the wire rounds only
    # the contributions that travel.
    assert result["wire"] <= 0.5 * result["bf16_reduce_scatter"], result


class _Uneven(nn.Module):
    """Two parameters whose dim 0 does not divide by 4: at world 4 the last rank's chunk of ``a`` is
    short and it holds nothing of ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Parameter(torch.zeros(2047, 3)), nn.Parameter(torch.zeros(3))

    def forward(self, ca: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
        return (self.a * ca).sum() + (self.b * cb).sum()


def _uneven_gradient_wire() -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(11)
    contributions_a = [torch.randn(2047, 3, generator=generator) * (1 + r) for r in range(world)]
    contributions_b = [torch.randn(3, generator=generator) for _ in range(world)]
    model = _Uneven()
    fully_shard(model, comm_policy=CommPolicy(reduce_wire_dtype=torch.bfloat16))
    for _ in range(2):  # the second step adds to the sharded gradients
        model(contributions_a[rank], contributions_b[rank]).backward()
    return {
        name: (param.grad.full_tensor() - 2 * _own_chunk_reference(contributions, world)).abs().max().item()
        for name, param, contributions in (("a", model.a, contributions_a), ("b", model.b, contributions_b))
    }


def test_bf16_wire_sums_uneven_shards_with_each_ranks_own_chunk_unrounded(dist):
    result = dist.run(4, _uneven_gradient_wire)[0]
    assert result == {"a": 0.0, "b": 0.0}, result


def _bf16_gradient_wire() -> dict:
    """Gradients computed in bf16 (``param_dtype=torch.bfloat16``, the usual training setting): the
    wire's rounding is then a no-op, so only the reduction's own arithmetic differs between the
    bf16 wire, FSDP2's default bf16 reduce-scatter and a float32 reduce-scatter."""
    world, rank = dist.get_world_size(), dist.get_rank()
    contributions = _contributions(world)
    exact = sum(c.bfloat16().double() for c in contributions) / world
    out = {}
    for name, kwargs in (
        ("wire", {"comm_policy": CommPolicy(reduce_wire_dtype=torch.bfloat16)}),
        ("bf16_reduce_scatter", {}),  # FSDP2's default: the reduce dtype is param_dtype
        ("float32_reduce_scatter", {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}),
    ):
        grad, reduce_scatters = _reduced(contributions[rank], **{"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16), **kwargs})
        out[name] = (grad.double() - exact).abs().max().item()
        out[f"{name}_bytes"] = sum(r.nbytes for r in reduce_scatters)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_wire_on_bf16_gradients_is_as_exact_as_a_float32_reduce_scatter_at_half_its_bytes(dist, world):
    result = dist.run(world, _bf16_gradient_wire)[0]
    assert result["wire_bytes"] == result["bf16_reduce_scatter_bytes"] == result["float32_reduce_scatter_bytes"] // 2 == 8192 * 2
    assert result["bf16_reduce_scatter"] > 0, result
    # The float32 sums of at most four bf16 values round only where their exponents lie far apart.
    assert result["wire"] <= result["float32_reduce_scatter"] + 1e-6, result
    assert result["wire"] <= 0.01 * result["bf16_reduce_scatter"], result


def _train(policy: CommPolicy, mode: str, steps: int, config: TransformerConfig = UNTIED) -> list[float]:
    torch._dynamo.reset()
    model = shard_model(sharded_copy(build_reference(config)), fully_shard, comm_policy=policy)
    runner = torch.compile(model, backend="fsdp_aot_eager") if mode == "compiled" else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for batch in global_batches(steps, 2, dist.get_world_size(), config, seed=3):
        tokens = local_part(batch)
        loss = next_token_loss(runner(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


POLICIES = {
    "int8": CommPolicy(all_gather_dtype=torch.int8),
    # Compiles are the cost here: the bf16 wire rides along with the fp8 all-gather.
    "fp8_bf16_wire": CommPolicy(all_gather_dtype=torch.float8_e4m3fn, reduce_wire_dtype=torch.bfloat16),
}


def _eager_and_compiled(policy_name: str) -> dict:
    policy = POLICIES[policy_name]
    return {"eager": _train(policy, "eager", 3), "compiled": _train(policy, "compiled", 3)}


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_quantized_all_gathers_and_the_bf16_wire_train_alike_eager_and_compiled(dist, policy_name):
    result = dist.run(2, _eager_and_compiled, policy_name)[0]
    for eager, compiled in zip(result["eager"], result["compiled"]):
        assert abs(eager - compiled) <= 1e-5 * max(1.0, abs(eager)), result


def _convergence() -> dict:
    return {"full": _train(CommPolicy(), "eager", 50), "int8": _train(POLICIES["int8"], "eager", 50)}


def test_int8_all_gather_training_converges_like_full_precision(dist):
    result = dist.run(2, _convergence)[0]
    assert result["full"][-1] < 0.8 * result["full"][0], result["full"]  # it did learn
    assert abs(result["int8"][-1] - result["full"][-1]) <= 0.02 * result["full"][-1], (result["int8"][-1], result["full"][-1])


class _WithCounter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.steps = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)

    def forward(self, x):
        return self.proj(x)


def _guard_rails() -> dict:
    cases = {
        "integer parameter": (_WithCounter, CommPolicy(all_gather_dtype=torch.int8)),
        "block size": (lambda: nn.Linear(4, 4), CommPolicy(all_gather_dtype=torch.int8, block_size=100)),
        "wire dtype": (lambda: nn.Linear(4, 4), CommPolicy(all_gather_dtype=torch.float16)),
        "reduce wire": (lambda: nn.Linear(4, 4), CommPolicy(reduce_wire_dtype=torch.int8)),
    }
    messages = {}
    with count_process_group_calls() as calls:
        for name, (build, policy) in cases.items():
            try:
                fully_shard(build(), comm_policy=policy)
                messages[name] = ""
            except ValueError as error:
                messages[name] = str(error)
    return {"messages": messages, "calls": list(calls)}


def test_a_policy_that_cannot_apply_fails_at_fully_shard_before_any_collective(dist):
    result = dist.run(2, _guard_rails)[0]
    messages = result["messages"]
    assert "'steps' has dtype torch.int64" in messages["integer parameter"] and "ignored_params" in messages["integer parameter"]
    assert "multiple of 16" in messages["block size"] and "100" in messages["block size"]
    assert "torch.int8 or torch.float8_e4m3fn" in messages["wire dtype"]
    assert "floating-point" in messages["reduce wire"]
    assert result["calls"] == []
