"""The compiled path: fsdp_inductor, the skip_fsdp_hooks fallback and compiled autograd vs our eager runtime."""
from __future__ import annotations

import time
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

import fsdp_compile
from fsdp_compile.models import next_token_loss
from fsdp_compile.passes.graph import DELIVER_GRADIENT, DELIVER_REDUCE_SCATTER_LATE
from fsdp_testing import UNEVEN, block_compile_mode, build_reference, global_batches, local_part, make_optimizer, shard_model, sharded_copy

STEPS = 3


def _forward_backward(runner, micro, micro_batches):
    loss = next_token_loss(runner(micro), micro) / micro_batches
    loss.backward()
    return loss.detach()


def _train(model, batches, compiled_model=None, micro_batches: int = 1, compiled_step=None):
    runner = compiled_model if compiled_model is not None else model
    step = compiled_step or _forward_backward
    # SGD: AdamW's normalised step turns a reduction-order difference in a near-zero gradient into
    # a full learning-rate step, so parameters compared after AdamW differ by noise, not by bugs.
    optimizer = make_optimizer("sgd", model.parameters())
    losses = []
    graphs_after_first_step = None
    for batch in batches:
        local = local_part(batch)
        total = 0.0
        micros = local.chunk(micro_batches)
        for index, micro in enumerate(micros):
            if micro_batches > 1:
                model.set_requires_gradient_sync(index == len(micros) - 1)
            total += step(runner, micro, micro_batches).item()
        optimizer.step()
        optimizer.zero_grad()
        value = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(value)
        losses.append(value.item() / dist.get_world_size())
        if graphs_after_first_step is None:
            graphs_after_first_step = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    _train.graphs_after_first_step = graphs_after_first_step
    return losses


def _full_params(model):
    return [p.full_tensor() for p in model.parameters()]


class RestoredState(NamedTuple):
    state_kinds: set[str]  # type names of the state dict's values
    max_output_gap: float  # between the compiled model and an eager one loaded from its state dict


class CompiledVsEager(NamedTuple):
    eager_losses: list[float]
    compiled_losses: list[float]
    max_param_gap: float  # between the eagerly and the compiled trained parameters
    frames: dict  # Dynamo's stats plus after_first_step, joint_graphs_seen_by_our_passes, gradient_deliveries, compiled_autograd_captures, moved
    graph_breaks: int
    restored: RestoredState | None = None  # with_state_dict: the compiled model's state dict loaded into an eager one


def _compiled_vs_eager(
    mode: str, param_dtype_name: str | None = None, micro_batches: int = 1, hsdp_and_frozen: bool = False,
    backend: str = "fsdp_inductor", with_state_dict: bool = False,
):
    """Train the same model eagerly and compiled (``mode``; ``backend``: fsdp_inductor, or
    fsdp_aot_eager where code generation is not what a test is about, to save its compile time);
    return losses, max parameter difference and what was compiled, and with ``with_state_dict``
    what an eager model loaded from the compiled model's state dict computes."""
    torch._dynamo.reset()
    param_dtype = getattr(torch, param_dtype_name) if param_dtype_name else None
    policy = fsdp_compile.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    # UNEVEN (2 blocks, 37-row embedding): small enough to compile fast, and its shards are padded.
    batches = global_batches(STEPS, 2 * micro_batches, dist.get_world_size(), UNEVEN)
    reference = build_reference(UNEVEN)
    extra = {}
    if hsdp_and_frozen:
        from torch.distributed.device_mesh import init_device_mesh

        extra["mesh"] = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
        reference.layers[0].attention.wq.weight.requires_grad_(False)
    initial = [p.detach().clone() for p in reference.parameters()]
    eager = shard_model(sharded_copy(reference), fsdp_compile.fully_shard, mp_policy=policy, **extra)
    compiled = shard_model(sharded_copy(reference), fsdp_compile.fully_shard, mp_policy=policy, **extra)
    eager_losses = _train(eager, batches, micro_batches=micro_batches)
    torch._dynamo.utils.counters.clear()
    previous_ca = torch._dynamo.config.compiled_autograd
    with fsdp_compile.compile.backend.observe_graphs() as graphs:
        try:
            if mode == "fsdp_inductor":
                runner = torch.compile(compiled, backend=backend, fullgraph=True)
            elif mode == "fallback":
                fsdp_compile.config.skip_fsdp_hooks = True
                runner = torch.compile(compiled, backend="inductor")
            elif mode == "compiled_autograd":
                # Compiled autograd traces backward calls made inside a compiled region: compile the step.
                torch._dynamo.config.compiled_autograd = True
                runner = compiled
                step = torch.compile(_forward_backward, backend=backend)
            elif mode == "fallback_step":
                # aot_eager: what is tested is where the step's graphs break for the hooks; the
                # fallback under Inductor is test_skip_fsdp_hooks_fallback_runs_hooks_eagerly_with_equal_numerics.
                fsdp_compile.config.skip_fsdp_hooks = True
                runner = compiled
                step = torch.compile(_forward_backward, backend="aot_eager")
            elif mode == "fallback_compiled_autograd":
                fsdp_compile.config.skip_fsdp_hooks = True
                torch._dynamo.config.compiled_autograd = True
                runner = compiled
                step = torch.compile(_forward_backward, backend="inductor")
            else:
                raise ValueError(mode)
            compiled_losses = _train(compiled, batches, runner, micro_batches=micro_batches, compiled_step=step if mode.endswith(("compiled_autograd", "_step")) else None)
        finally:
            fsdp_compile.config.skip_fsdp_hooks = False
            torch._dynamo.config.compiled_autograd = previous_ca
    frames = dict(torch._dynamo.utils.counters["stats"])
    frames["after_first_step"] = _train.graphs_after_first_step
    frames["joint_graphs_seen_by_our_passes"] = sum(kind == "joint" for kind, _ in graphs)
    frames["gradient_deliveries"] = sum(_gradient_deliveries(graph) for kind, graph in graphs if kind != "joint")
    frames["compiled_autograd_captures"] = torch._dynamo.utils.counters["compiled_autograd"]["captures"]
    # The dtypes the compiled forward's matrix products compute in (mixed precision's point).
    products = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    frames["forward_matmul_dtypes"] = sorted({
        str(node.meta["val"].dtype) for kind, graph in graphs if kind == "forward"
        for node in graph.graph.nodes if node.target in products and isinstance(node.meta.get("val"), torch.Tensor)
    })
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    param_diff = max((a - b).abs().max().item() for a, b in zip(_full_params(eager), _full_params(compiled)))
    frames["moved"] = max((a - b).abs().max().item() for a, b in zip(_full_params(eager), initial))
    restored = None
    if with_state_dict:  # after the counts above: its forward must not add to them
        restored = _restored_from_state_dict(
            compiled, runner, lambda: shard_model(sharded_copy(reference), fsdp_compile.fully_shard, mp_policy=policy, **extra),
        )
    return CompiledVsEager(eager_losses, compiled_losses, param_diff, frames, breaks, restored)


def _restored_from_state_dict(trained, compiled, build_eager) -> RestoredState:
    """Load ``trained``'s state dict into a new eager model (``build_eager()``); compare their
    outputs, the trained one run through ``compiled``."""
    state = trained.state_dict()
    # The training batches' local shape and grad mode, and no FSDP model built yet (a new one fails
    # the compiled hooks' guard on the states' generation): the compiled graphs run as they are,
    # with no recompile.
    tokens = global_batches(1, 2, 1, UNEVEN, seed=7)[0]
    compiled_output = compiled(tokens).detach()
    restored = build_eager()
    restored.load_state_dict(state)
    difference = (compiled_output - restored(tokens).detach()).abs().max().item()
    return RestoredState({type(v).__name__ for v in state.values()}, difference)


def _gradient_deliveries(graph: torch.fx.GraphModule) -> int:
    """Calls that hand a reduced gradient to the runtime ([Note: late reduce-scatter wait across block
    frames] in fsdp_compile/module.py), immediate or late."""
    return sum(node.target in (DELIVER_GRADIENT, DELIVER_REDUCE_SCATTER_LATE) for node in graph.graph.nodes)


def _assert_matches_eager(result: CompiledVsEager, loss_rtol=1e-6, param_atol=1e-5):
    for step, (a, b) in enumerate(zip(result.eager_losses, result.compiled_losses)):
        assert abs(a - b) <= loss_rtol * abs(a), f"step {step}: eager {a} vs compiled {b}"
    assert result.max_param_gap <= param_atol, f"parameters differ by {result.max_param_gap}"
    # The eager model trained, by far more than the tolerance: the comparison can fail.
    assert result.eager_losses[0] != result.eager_losses[-1]
    assert result.frames["moved"] >= 10 * param_atol, f"parameters moved by only {result.frames['moved']}"


@pytest.fixture(scope="module")
def fullgraph_fp32(dist) -> CompiledVsEager:
    """One fp32 fsdp_inductor training run, compiled once for the tests that assert on it: its
    numerics and frames, and its state dict loaded into an eager model."""
    return dist.run(2, _compiled_vs_eager, "fsdp_inductor", with_state_dict=True)[0]


def test_fsdp_inductor_fullgraph_matches_eager_without_breaks_or_recompiles(fullgraph_fp32):
    result = fullgraph_fp32
    _assert_matches_eager(result)
    assert result.graph_breaks == 0
    assert result.frames["unique_graphs"] == result.frames["after_first_step"], "recompiled after the first step"
    # Inductor ran our joint-graph recompute pass (the cache-safe custom pass).
    assert result.frames["joint_graphs_seen_by_our_passes"] >= 1


def test_fsdp_inductor_bf16_mixed_precision_matches_eager_within_bf16_rounding(dist):
    result = dist.run(2, _compiled_vs_eager, "fsdp_inductor", "bfloat16")[0]
    # Parameters move by about 4e-2 in these steps and compiled bf16 lands within about 4e-4 of
    # eager bf16 (Inductor keeps fused intermediates in fp32): the tolerance sits between the two.
    _assert_matches_eager(result, loss_rtol=1e-2, param_atol=2e-3)
    assert result.graph_breaks == 0
    # Computed in bf16, as the eager runtime does (not fp32 that happens to land within tolerance).
    assert result.frames["forward_matmul_dtypes"] == ["torch.bfloat16"], result.frames["forward_matmul_dtypes"]


def test_compiled_hsdp_2x2_with_a_frozen_parameter_matches_eager(dist):
    # fsdp_aot_eager: the same trace, checks and graph passes as fsdp_inductor, without codegen.
    result = dist.run(4, _compiled_vs_eager, "fsdp_inductor", hsdp_and_frozen=True, backend="fsdp_aot_eager")[0]
    _assert_matches_eager(result)


def test_skip_fsdp_hooks_fallback_runs_hooks_eagerly_with_equal_numerics(dist):
    result = dist.run(2, _compiled_vs_eager, "fallback")[0]
    _assert_matches_eager(result)
    assert result.graph_breaks > 0, "the hooks should have run eagerly at graph breaks"


def test_compiled_autograd_gradients_equal_eager(dist):
    # fsdp_inductor: compiled autograd's graphs carry inputs that fsdp_aot_eager's direct AOT call refuses.
    result = dist.run(2, _compiled_vs_eager, "compiled_autograd")[0]
    _assert_matches_eager(result)
    assert result.frames["compiled_autograd_captures"] > 0, "compiled autograd did not trace the backward"
    # Compiled autograd's one backward graph returns the gradients: no block frame hands its reduced
    # gradient over (a copy into .grad per parameter there); plain frames do (test_block_frames.py).
    assert result.frames["gradient_deliveries"] == 0, result.frames


def test_state_dict_of_compiled_model_loads_into_eager_model(fullgraph_fp32):
    result = fullgraph_fp32.restored
    assert result.state_kinds == {"DTensor"}
    assert result.max_output_gap < 1e-5


class _RankDependent(torch.nn.Module):
    def __init__(self, rank_dependent: bool = True):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.rank_dependent = rank_dependent

    def forward(self, x):
        x = self.a(x)
        if not self.rank_dependent or dist.get_rank() == 0:  # else only rank 0 gathers b's parameters
            x = self.b(x)
        return x


class DivergedCompile(NamedTuple):
    error: str  # what compiling the rank-dependent model raised ("" if nothing)
    seconds_to_error: float
    later_output_shape: tuple[int, ...]  # of the same code compiled again without the divergence


def _rank_dependent_control_flow(frames: bool):
    with block_compile_mode("frames" if frames else "regions"):
        return _rank_dependent_control_flow_in_this_mode()


def _rank_dependent_control_flow_in_this_mode():
    torch._dynamo.reset()
    model = _RankDependent()
    fsdp_compile.fully_shard(model.a)
    fsdp_compile.fully_shard(model.b)
    fsdp_compile.fully_shard(model)
    start = time.monotonic()
    message = ""
    try:
        # fsdp_aot_eager: the cross-rank checks are fsdp_inductor's; code generation is not the subject.
        torch.compile(model, backend="fsdp_aot_eager")(torch.randn(2, 8))
    except Exception as error:  # noqa: BLE001
        message = str(error)
    seconds = time.monotonic() - start
    # The same code compiled again with matching collectives on every rank (a caller that caught
    # the error and went on) is not judged by what the diverged compile left in the store.
    torch._dynamo.reset()
    again = _RankDependent(rank_dependent=False)  # the same code: the diverged compile's store keys
    fsdp_compile.fully_shard(again.a)
    fsdp_compile.fully_shard(again.b)
    fsdp_compile.fully_shard(again)
    output = torch.compile(again, backend="fsdp_aot_eager")(torch.randn(2, 8))
    return DivergedCompile(message, seconds, tuple(output.shape))


@pytest.mark.parametrize("frames", [True, False], ids=["blocks_as_frames", "one_graph"])
def test_rank_dependent_collectives_fail_before_any_collective_with_the_ranks_named(dist, frames):
    for rank, result in enumerate(dist.run(2, _rank_dependent_control_flow, frames)):
        message = result.error
        if frames:  # every rank compiles the same frames: the blocks they enter differ
            assert "ranks entered different fully_shard blocks in one compiled forward" in message, message
            mine, other = ("a -> b", "a -> end of forward") if rank == 0 else ("a -> end of forward", "a -> b")
            assert f"rank {rank} entered {mine}" in message and f"rank {1 - rank} entered {other}" in message, message
        else:
            assert "ranks traced graphs with different collectives" in message, message
            assert "rank 0 traced collectives" in message, message
        assert "ranks [0, 1] differ" in message, message
        # Found while both ranks wait in the store, not after the timeout: no hang.
        assert result.seconds_to_error < fsdp_compile.config.graph_check_timeout_s / 2
        assert result.later_output_shape == (2, 8)


def test_fallback_inside_a_compiled_training_step_matches_eager(dist):
    _assert_matches_eager(dist.run(2, _compiled_vs_eager, "fallback_step")[0])


def _fallback_under_compiled_autograd():
    try:
        _compiled_vs_eager("fallback_compiled_autograd")
    except RuntimeError as error:
        return str(error)
    return ""


def test_fallback_under_compiled_autograd_is_refused_clearly(dist):
    for message in dist.run(2, _fallback_under_compiled_autograd):
        assert "compiled autograd cannot trace" in message and "backend='fsdp_inductor'" in message


class CompiledSteps(NamedTuple):
    forward_graphs: int  # compiled in the first step
    collectives: dict  # per collective kind, in the second step


class CollectivesInOneProcess(NamedTuple):
    eager: dict  # collectives per step of the eager runtime
    alone: CompiledSteps  # an fsdp_inductor model compiled alone
    after_fallback: CompiledSteps  # one compiled after a skip_fsdp_hooks model ran
    fallback_before: dict  # the skip_fsdp_hooks model's collectives per step, before and after that
    fallback_after: dict


def _fallback_and_fsdp_inductor_in_one_process():
    """Collectives per step and compiled graphs of an fsdp_inductor model compiled alone, and of
    one compiled after a skip_fsdp_hooks model has run in the same process. (After the fallback's
    trace of a parameter read, which holds no op, Dynamo skips that code for good: the next model's
    first read of its root group runs eagerly, and gathered the group per parameter, twice the
    collectives, until it took a graph of its own; see _gather_group_in_a_graph in state.py.)"""
    from benchmarks.measure import count_collectives

    torch._dynamo.reset()
    batches = global_batches(2, 2, dist.get_world_size(), UNEVEN)
    reference = build_reference(UNEVEN)

    def step(runner, batch):
        local = local_part(batch)
        next_token_loss(runner(local), local).backward()

    def first_and_second_step(runner):
        with fsdp_compile.compile.backend.observe_graphs() as graphs:
            step(runner, batches[0])
        with count_collectives() as counts:
            step(runner, batches[1])
        return CompiledSteps(sum(kind == "forward" for kind, _ in graphs), dict(counts))

    def fallback_step(runner):
        fsdp_compile.config.skip_fsdp_hooks = True
        try:
            with count_collectives() as counts:
                step(runner, batches[1])
        finally:
            fsdp_compile.config.skip_fsdp_hooks = False
        return dict(counts)

    eager = shard_model(sharded_copy(reference), fsdp_compile.fully_shard)
    with count_collectives() as eager_counts:
        step(eager, batches[1])
    alone = first_and_second_step(torch.compile(shard_model(sharded_copy(reference), fsdp_compile.fully_shard), backend="fsdp_aot_eager"))

    torch._dynamo.reset()
    fallback = torch.compile(shard_model(sharded_copy(reference), fsdp_compile.fully_shard), backend="aot_eager")
    fallback_before = fallback_step(fallback)
    after_fallback = first_and_second_step(torch.compile(shard_model(sharded_copy(reference), fsdp_compile.fully_shard), backend="fsdp_aot_eager"))
    fallback_after = fallback_step(fallback)
    return CollectivesInOneProcess(dict(eager_counts), alone, after_fallback, fallback_before, fallback_after)


def test_fallback_and_fsdp_inductor_models_in_one_process_keep_their_own_collectives(dist):
    r = dist.run(2, _fallback_and_fsdp_inductor_in_one_process)[0]
    # The fsdp_inductor model's collectives per step, and the fallback's (the eager runtime's), are
    # the same whether or not the other model ran first in the process.
    assert r.alone.forward_graphs >= 1, "the fsdp_inductor model compiled no graph"
    # The collectives per step are the same; the graphs may split differently (the first root read,
    # run eagerly after the fallback, gathers in a graph of its own where alone its frame compiled it).
    assert r.after_fallback.collectives == r.alone.collectives, f"after a fallback model: {r.after_fallback}, alone: {r.alone}"
    assert r.after_fallback.forward_graphs >= 1, r.after_fallback
    assert r.fallback_before == r.eager and r.fallback_after == r.eager, (r.fallback_before, r.fallback_after, r.eager)
