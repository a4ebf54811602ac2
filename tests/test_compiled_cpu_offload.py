"""CPUOffloadPolicy under a whole-model torch.compile with blocks compiled as frames (the default): the
shards and gradients stay in host memory, every group's all-gather is the runtime's frame_all_gather on
the host shards, and the model trains as eagerly ([Note: offloaded shards under whole-model compile] in
compile/param_reads.py). Blocks compiled as regions keep refusing it (test_compiled_settings.py)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from benchmarks.measure import count_collectives
from fsdp_compile import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from fsdp_compile.annotations import BLOCK_FRAME_TOKEN, KEEPS_GATHERED_KEY, STATE_KEY
from fsdp_compile.compile.backend import observe_graphs
from fsdp_compile.compile.param_reads import trace_annotation
from fsdp_compile.passes.graph import ALL_GATHER, FRAME_GATHER, WAIT, fsdp_annotation
from fsdp_compile.passes.recompute import gather_frames_through_prefetch
from fsdp_testing import BlocksNet
from test_block_frames import _frame_gathers
from test_compile_blocks import _modules_run_eagerly

BLOCKS = 3
STEPS = 3


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _train(mode: str, offload: bool, bf16: bool) -> dict:
    """``STEPS`` AdamW steps of BlocksNet (the root's input layer and head around ``BLOCKS`` blocks, every
    group offloaded or not), eagerly (``mode`` "eager") or compiled with the backend ``mode``: per step
    the collectives, where the shards and gradients live; Dynamo's graphs, the modules that ran eagerly,
    the all-gathers of the compiled graphs by kind, the frames' prefetches taken, the parameters after."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = BlocksNet(BLOCKS)
    kwargs: dict = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    initial = [p.full_tensor().detach().clone() for p in model.parameters()]
    runner = model if mode == "eager" else torch.compile(model, backend=mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(10 + dist.get_rank())
    result: dict = {"collectives": [], "shard_devices": set(), "grad_devices": set(), "losses": []}
    with warnings.catch_warnings(record=True) as caught, observe_graphs() as graphs, _frame_gathers() as gathers:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            with count_collectives() as counts:
                loss = runner(torch.randn(4, 8, generator=generator)).square().mean()
                loss.backward()
            result["collectives"].append({kind: n for kind, n in sorted(counts.items()) if n})
            result["losses"].append(loss.item())
            result["grad_devices"] |= {_local(p.grad).device.type for p in model.parameters()}
            optimizer.step()
            optimizer.zero_grad()
            result["shard_devices"] |= {_local(p).device.type for p in model.parameters()}
    result["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    result["run_eagerly"] = _modules_run_eagerly(caught)
    result["gathers"] = sorted(
        _gather_kind(node) for kind, gm in graphs if kind in ("forward", "backward")
        for node in gm.graph.nodes if node.target in (ALL_GATHER, FRAME_GATHER)
    )
    result["prefetches_taken"] = sum(taken for backward in (False, True) for event, _, taken in gathers[backward] if event == "gathers")
    result["params"] = [p.full_tensor().detach() for p in model.parameters()]
    result["moved"] = max((a - b).abs().max().item() for a, b in zip(result["params"], initial))
    return result


def _gather_kind(node: torch.fx.Node) -> str:
    """"frame: block", "frame: outside blocks" (the runtime's all-gather) or "graph" (a node of the graph)."""
    if node.target is not FRAME_GATHER:
        return "graph"
    annotation = fsdp_annotation(node) or {}
    if annotation.get(STATE_KEY) == BLOCK_FRAME_TOKEN:
        return "frame: block"
    return "frame: outside blocks" if annotation.get(KEEPS_GATHERED_KEY) else "frame: ?"


def _runs(backend: str, bf16: bool) -> dict:
    return {
        "eager": _train("eager", True, bf16),
        "compiled": _train(backend, True, bf16),
        "compiled_without_offload": _train(backend, False, bf16),
    }


def _check_trains_as_eager(runs: dict, tolerance: float) -> None:
    eager, compiled, plain = runs["eager"], runs["compiled"], runs["compiled_without_offload"]
    assert "error" not in compiled, compiled
    assert compiled["shard_devices"] == compiled["grad_devices"] == {"cpu"}
    assert compiled["collectives"] == eager["collectives"], (compiled["collectives"], eager["collectives"])
    assert eager["collectives"][0]["all_gather"] > 0 and eager["collectives"][0]["reduce_scatter"] > 0
    gap = max((a - b).abs().max().item() for a, b in zip(eager["params"], compiled["params"]))
    assert gap <= tolerance, gap
    assert eager["moved"] > 1e-3  # trained: equal to eager's not because nothing moved
    # Offload adds no graph and runs no block eagerly: the graphs are those of the same model without it.
    assert compiled["run_eagerly"] == [] and compiled["graphs"] == plain["graphs"], (compiled["graphs"], plain["graphs"])
    # Every all-gather is the runtime's: the blocks' frame op, and the root's routed through it too
    # (without offload the root's all-gather is a node of its graph); the frames take their prefetches.
    assert set(compiled["gathers"]) == {"frame: block", "frame: outside blocks"}, compiled["gathers"]
    assert "graph" in plain["gathers"] and "frame: outside blocks" not in plain["gathers"], plain["gathers"]
    assert compiled["prefetches_taken"] == plain["prefetches_taken"] > 0


@pytest.mark.parametrize("backend, tolerance", [("fsdp_aot_eager", 0.0), ("fsdp_inductor", 1e-5)])
def test_compiled_offloaded_model_keeps_shards_and_gradients_on_the_host_and_trains_as_eager(dist, backend, tolerance):
    runs = dist.run(2, _runs, backend, False)[0]
    _check_trains_as_eager(runs, tolerance)


def test_compiled_offloaded_model_with_bf16_mixed_precision_trains_as_eager(dist):
    runs = dist.run(2, _runs, "fsdp_aot_eager", True)[0]
    _check_trains_as_eager(runs, 0.0)


def _node(graph: torch.fx.Graph, target, args: tuple, value: torch.Tensor, annotation: dict | None = None) -> torch.fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = value
    if annotation is not None:
        node.meta["custom"] = annotation
    return node


def test_a_block_frames_all_gather_is_handed_the_host_shard_not_its_copy_on_the_device():
    """passes/recompute.gather_frames_through_prefetch on a lone offloaded parameter's read, built by
    hand (the meta device stands in for the GPU)::

        before:  shard (host) -> device_put -> view(-1) -> all_gather -> wait
        after:   shard (host) -> frame_all_gather(..., device) -> wait
    """
    annotation = trace_annotation("Block (block frame)", "weight", True, BLOCK_FRAME_TOKEN)
    graph = torch.fx.Graph()
    shard = graph.placeholder("shard")
    shard.meta["val"] = torch.empty(4)
    copied = _node(graph, torch.ops.prims.device_put.default, (shard, torch.device("meta")), torch.empty(4, device="meta"), annotation)
    flat = _node(graph, torch.ops.aten.view.default, (copied, [-1]), torch.empty(4, device="meta"), annotation)
    gather = _node(graph, ALL_GATHER, (flat, 2, "group"), torch.empty(8, device="meta"), annotation)
    graph.output(_node(graph, WAIT, (gather,), torch.empty(8, device="meta"), annotation))
    assert gather_frames_through_prefetch(graph, backward=False) == 1
    graph.lint()
    calls = [node for node in graph.nodes if node.op == "call_function"]
    assert [node.target for node in calls] == [FRAME_GATHER, WAIT]
    assert calls[0].args == ([shard], [4], torch.float32, 2, "group", False, torch.device("meta"))

