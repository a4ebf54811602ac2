"""set_reshard_after_backward(False) under a whole-model torch.compile (blocks compiled as frames, the
default): gradient accumulation keeps the parameters gathered across micro-batches, so the next forward
sends no all-gather, as eagerly ([Note: keeping parameters gathered across a backward] in compile/kept_gathers.py)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from benchmarks.measure import count_collectives
from fsdp_compile import FSDPModule, fully_shard
from fsdp_compile.runtime.state import state_of
from fsdp_testing import BlocksNet

MICRO_BATCHES = 3
BLOCKS = 3


def _accumulate(compiled: bool, keep_gathered: bool, reshard_after_forward: bool) -> dict:
    """Two optimizer steps of ``MICRO_BATCHES`` micro-batches, FSDP2's gradient accumulation: no
    sync and (``keep_gathered``) no reshard after backward but in the last. Per micro-batch: the
    all-gathers, reduce-scatters and Dynamo's graphs so far; the gradients before each optimizer
    step and the parameters after the last."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = BlocksNet(BLOCKS)  # the root's own input layer and head (one group) around the blocks
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model)
    runner = torch.compile(model, backend="fsdp_aot_eager") if compiled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(10 + dist.get_rank())
    result: dict = {"all_gathers": [], "reduce_scatters": [], "graphs": [], "grads": []}
    for _ in range(2):
        for index in range(MICRO_BATCHES):
            last = index == MICRO_BATCHES - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last or not keep_gathered)
            x = torch.randn(4, 8, generator=generator)
            with count_collectives() as counts:
                (runner(x).square().mean() / MICRO_BATCHES).backward()
            result["all_gathers"].append(counts.get("all_gather", 0))
            result["reduce_scatters"].append(counts.get("reduce_scatter", 0))
            result["graphs"].append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        result["grads"].append([p.grad.full_tensor() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    result["params"] = [p.full_tensor().detach() for p in model.parameters()]
    return result


def _eager_and_compiled(reshard_after_forward: bool) -> dict:
    return {
        (compiled, keep): _accumulate(compiled, keep, reshard_after_forward) for compiled in (False, True) for keep in (True, False)
    }


def _check_compiled_as_eager(runs: dict) -> None:
    eager, compiled = runs[(False, True)], runs[(True, True)]
    assert compiled["all_gathers"] == eager["all_gathers"], (compiled["all_gathers"], eager["all_gathers"])
    assert compiled["reduce_scatters"] == eager["reduce_scatters"]
    for step_eager, step_compiled in zip(eager["grads"], compiled["grads"]):
        assert all(torch.equal(a, b) for a, b in zip(step_eager, step_compiled))
    assert all(torch.equal(a, b) for a, b in zip(eager["params"], compiled["params"]))
    # The parameters moved (not vacuously equal), and keeping them gathered changed no numerics.
    assert max((a - b).abs().max().item() for a, b in zip(compiled["params"], runs[(True, False)]["params"])) == 0.0
    assert max(g.abs().max().item() for g in compiled["grads"][0]) > 1e-3


def test_compiled_accumulation_keeping_parameters_gathered_sends_eagers_all_gathers(dist):
    runs = dist.run(2, _eager_and_compiled, True)[0]
    _check_compiled_as_eager(runs)
    # Eagerly: the first micro-batch gathers every group in forward (the root and each block) and the
    # resharding blocks again in backward; the later ones only the blocks' backward, the rest kept.
    first, later = 1 + 2 * BLOCKS, BLOCKS
    assert runs[(False, True)]["all_gathers"] == ([first] + [later] * (MICRO_BATCHES - 1)) * 2
    # What the setting changes: without it every micro-batch gathers as the first.
    assert runs[(True, False)]["all_gathers"] == runs[(False, False)]["all_gathers"] == [first] * MICRO_BATCHES * 2
    assert runs[(True, True)]["reduce_scatters"] == ([0] * (MICRO_BATCHES - 1) + [1 + BLOCKS]) * 2
    # Graphs: the block frame's never read the setting; the root's first graph traces its gather through
    # the runtime either way here (the setting False, or a kept gather waiting for the last micro-batch),
    # so the setting adds no graph: the synced micro-batch compiles the same two again as without it.
    assert runs[(True, True)]["graphs"] == runs[(True, False)]["graphs"]
    graphs = runs[(True, True)]["graphs"]
    assert graphs == [graphs[0]] * (MICRO_BATCHES - 1) + [graphs[0] + 2] * (MICRO_BATCHES + 1), graphs


def test_compiled_accumulation_keeping_blocks_unsharded_after_forward_sends_no_later_all_gather(dist):
    runs = dist.run(2, _eager_and_compiled, False)[0]
    _check_compiled_as_eager(runs)
    # reshard_after_forward=False: backward gathers nothing, and a micro-batch after the first nothing.
    first = 1 + BLOCKS
    assert runs[(False, True)]["all_gathers"] == ([first] + [0] * (MICRO_BATCHES - 1)) * 2
    assert runs[(True, False)]["all_gathers"] == [first] * MICRO_BATCHES * 2


def _reshard_after_a_kept_micro_batch(compiled: bool) -> dict:
    """A micro-batch that keeps its parameters gathered, then ``reshard()`` on every FSDP module, then
    another micro-batch: the groups holding a kept gather before and after the reshard, the second
    micro-batch's all-gathers."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = BlocksNet(BLOCKS)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    runner = torch.compile(model, backend="fsdp_aot_eager") if compiled else model
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    frames = state_of(model).root_frames

    def kept() -> int:
        return sum(block.kept.holds for block in frames.blocks.values())

    runner(torch.randn(4, 8)).square().mean().backward()
    result = {"kept_before": kept()}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    result["kept_after"] = kept()
    with count_collectives() as counts:
        runner(torch.randn(4, 8)).square().mean().backward()
    result["all_gathers"] = counts.get("all_gather", 0)
    return result


def _reshard_eager_and_compiled() -> list[dict]:
    return [_reshard_after_a_kept_micro_batch(compiled) for compiled in (False, True)]


def test_reshard_frees_the_gathers_kept_for_the_next_forward(dist):
    eager, compiled = dist.run(2, _reshard_eager_and_compiled)[0]
    assert compiled["kept_before"] == 1 + BLOCKS and compiled["kept_after"] == 0, compiled
    # Eagerly reshard() frees the unsharded parameters: the next micro-batch gathers every group in
    # forward and the resharding blocks again in backward. Compiled, the same: nothing kept is taken.
    assert eager["all_gathers"] == compiled["all_gathers"] == 1 + 2 * BLOCKS, (eager, compiled)


def test_a_backward_graph_gets_its_parameters_columns_of_the_kept_whole_group_gather():
    """The kept gather is the group's whole all-gather ([world, every parameter's padded shard]); a
    backward graph that gathers only some parameters (what backward reads) gets their columns, in its
    order, as a tensor of its own (the graph may reuse its buffers; the kept one must stay)."""
    from fsdp_compile.compile.kept_gathers import columns_for_graph

    world, numels = 2, [3, 2, 4]
    rows = [torch.arange(sum(numels)) + 100 * rank for rank in range(world)]  # rank r's slot: its shards' copy-in
    gathered = torch.cat(rows)
    whole = ((0, 1, 2), numels, torch.int64, world, "group")
    cut = columns_for_graph(gathered, whole, ((2, 0), [4, 3], torch.int64, world, "group"))
    assert cut.tolist() == [5, 6, 7, 8, 0, 1, 2, 105, 106, 107, 108, 100, 101, 102]
    same = columns_for_graph(gathered, whole, whole)
    assert torch.equal(same, gathered) and same.data_ptr() != gathered.data_ptr()
