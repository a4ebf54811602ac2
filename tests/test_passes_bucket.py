"""passes/bucket.py on graphs traced with a fake process group (world 8 and 64), in one process."""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_compile
from fsdp_compile.compile.backend import observe_graphs
from fsdp_compile.config import PassConfig
from fsdp_compile.models import Transformer, TransformerConfig
from fsdp_compile.passes import apply_post_grad_passes
from fsdp_compile.passes.bucket import bucket_collectives
from fsdp_compile.passes.reorder import reorder_collectives
from fsdp_compile.passes.graph import (
    ALL_GATHER, ALL_REDUCE, COPY_IN, COPY_OUT, FSDP_ANNOTATION_KEY, GROUP_KEY, REDUCE_SCATTER, WAIT, collective_nodes, fsdp_annotation,
    is_cast, one_wait_per_collective, pass_counters,
)

CONFIG = TransformerConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
GROUPS = {"Transformer", "layers.0", "layers.1"}


def _trace(passes: PassConfig, mp_policy=None, mesh=None, reshard_root=None):
    """(model, forward, backward) traced afresh, ``passes`` run by the fsdp_aot_eager backend."""
    torch._dynamo.reset()  # every call traces afresh (the same model class would hit Dynamo's cache)
    torch.manual_seed(0)
    model = Transformer(CONFIG)
    kwargs = {"mp_policy": mp_policy or fsdp_compile.MixedPrecisionPolicy()}
    if mesh is not None:
        kwargs["mesh"] = mesh
    for layer in model.layers:
        fsdp_compile.fully_shard(layer, **kwargs)
    fsdp_compile.fully_shard(model, reshard_after_forward=reshard_root, **kwargs)
    previous = fsdp_compile.config.passes
    fsdp_compile.config.passes = passes
    try:
        with observe_graphs() as graphs:
            torch.compile(model, backend="fsdp_aot_eager", fullgraph=True)(torch.randint(0, 64, (2, 8))).sum().backward()
    finally:
        fsdp_compile.config.passes = previous
    forward = next(g for kind, g in graphs if kind == "forward")
    backward = next(g for kind, g in graphs if kind == "backward")
    return model, forward, backward


# [Note: traced once, passes on copies]
# A trace costs seconds (Dynamo + AOTAutograd) and the passes are functions of the graph alone, so
# the graph tests trace the model once per setup (world size, mesh, mixed precision, root's
# reshard_after_forward) with the passes off, and run apply_post_grad_passes -- what fsdp_aot_eager
# runs on each partitioned graph -- on copies of those graphs: the same graphs a trace with the
# passes on yields (the determinism tests here and in test_passes_reorder.py compare the two). The
# result of each setup and PassConfig is kept too, with what the passes added to the give-up
# counters, added again on each later call as a trace would; so the graphs are shared between tests
# (test_compile_graphs.py's and test_cost_model.py's too): read them, never rewrite them. With
# FSDP_COMPILE_DUMP set the passes run on every call (and dump, as the backend would).
_untouched: dict[tuple, tuple] = {}
_passed: dict[tuple, tuple[tuple, Counter]] = {}


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with new nodes (the passes rewrite graphs in place); fake tensors shared, read-only."""
    graph = copy.deepcopy(gm.graph)  # each node's meta is a shallow copy
    for node in graph.nodes:
        if "custom" in node.meta:
            node.meta["custom"] = dict(node.meta["custom"])
    return fx.GraphModule(gm, graph)


def _traced(passes: PassConfig, mp_policy=None, mesh=None, reshard_root=None):
    """(model, forward, backward) as ``_trace`` yields them, from one trace per setup (see the Note)."""
    mp_policy = mp_policy or fsdp_compile.MixedPrecisionPolicy()
    mesh_key = None if mesh is None else (tuple(mesh.shape), mesh.mesh_dim_names)
    key = (dist.get_world_size(), mp_policy, mesh_key, reshard_root)
    if key not in _untouched:
        # dump_dir "" (not None): FSDP_COMPILE_DUMP, if set, is for the passes run below.
        _untouched[key] = _trace(PassConfig(bucket=False, reorder=False, dump_dir=""), mp_policy, mesh, reshard_root)
    passes = passes.resolved()
    if (key, passes) in _passed:
        result, counted = _passed[key, passes]
        pass_counters.update(counted)
        return result
    model, *graphs = _untouched[key]
    before = Counter(pass_counters)
    result = (model, *(apply_post_grad_passes(_copy(gm), passes) for gm in graphs))
    if not passes.dump_dir:
        _passed[key, passes] = result, pass_counters - before
    return result


def _graphs(passes: PassConfig, mp_policy=None, mesh=None):
    """(forward, backward) as fsdp_aot_eager compiles them with ``passes``; see [Note: traced once,
    passes on copies]."""
    _, forward, backward = _traced(passes, mp_policy, mesh)
    return forward, backward


def _groups(nodes):
    return [fsdp_annotation(n)[GROUP_KEY] for n in nodes]


def _program(gm: fx.GraphModule) -> list[tuple]:
    """Each node's op, target and arguments in graph order, an argument that is a node named by its
    position: what the graph's code runs, without the names torch.fx gave its nodes.

    [Note: graphs compared without names]
    A pass names a new node from the names its graph's namespace registered before. A copy of a
    graph (``_copy``) registers only the names of the nodes it holds; the trace also holds those of
    nodes it erased (the forward's ``t_10`` to ``t_20``, ``detach``). On torch 2.13 and 2.14.1 the
    copy and the trace still name the passes' nodes alike; torch 2.11 numbers a candidate name that
    carries a number from a count kept under the whole name (2.13: under its base), and there one
    ``aten.add`` of the bucketed graphs is ``add_2`` in the copy and ``add_3`` in the trace.
    Names change nothing the graph computes, and ranks are compared by their collectives alone
    ([Note: cross-rank graph check] in compile/graph_check.py), so the determinism tests compare
    programs: a node moved or rewired still tells two graphs apart."""
    position = {node: index for index, node in enumerate(gm.graph.nodes)}
    return [
        (node.op, str(node.target), repr(fx.node.map_arg((node.args, node.kwargs), lambda read: _Read(position[read]))))
        for node in gm.graph.nodes
    ]


class _Read(int):
    """A node read by position, in ``_program``'s arguments (a repr no constant can spell)."""

    def __repr__(self) -> str:
        return f"<node {int(self)}>"


def test_bucketing_leaves_one_all_gather_and_one_reduce_scatter_per_group(fake_world):
    forward, backward = _graphs(PassConfig(reorder=False))
    assert _groups(collective_nodes(forward.graph, ALL_GATHER)) == ["Transformer", "layers.0", "layers.1"]
    # Blocks reshard after forward: backward re-gathers them, one bucket each, last block first.
    assert _groups(collective_nodes(backward.graph, ALL_GATHER)) == ["layers.1", "layers.0"]
    # Each reduce-scatter goes out after its group's last gradient: the root's (embedding) is last.
    assert _groups(collective_nodes(backward.graph, REDUCE_SCATTER)) == ["layers.1", "layers.0", "Transformer"]
    assert all(n.args[1] == fake_world for n in collective_nodes(forward.graph, ALL_GATHER))
    assert pass_counters["bucket.gave_up"] == 0


def test_bucketed_collectives_move_every_parameter_of_the_group(fake_world):
    unbucketed, _ = _graphs(PassConfig(bucket=False, reorder=False))
    forward, _ = _graphs(PassConfig(reorder=False))
    per_param = sum(n.meta["val"].numel() for n in collective_nodes(unbucketed.graph, ALL_GATHER))
    bucketed = sum(n.meta["val"].numel() for n in collective_nodes(forward.graph, ALL_GATHER))
    assert bucketed == per_param


def test_mixed_precision_casts_happen_in_the_bucket_copy_in(fake_world):
    policy = fsdp_compile.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    forward, backward = _graphs(PassConfig(reorder=False), mp_policy=policy)
    copy_ins = [gather.args[0] for gather in collective_nodes(forward.graph, ALL_GATHER)]
    assert copy_ins and all(copy_in.meta["val"].dtype == torch.bfloat16 for copy_in in copy_ins)
    for copy_in in copy_ins:
        if copy_in.target is COPY_IN:
            # The op casts each float32 shard as it writes the bfloat16 bucket: no float32
            # bucket-sized temporary exists, and no cast of its own either.
            shards, padded_numels, dtype = copy_in.args
            assert dtype == torch.bfloat16 and all(shard.meta["val"].dtype == torch.float32 for shard in shards)
            assert sum(padded_numels) == copy_in.meta["val"].numel()
        else:  # a one-parameter bucket: the cast shard itself (spelled as each torch version traces it)
            assert is_cast(copy_in), copy_in.format_node()
    assert sum(copy_in.target is COPY_IN for copy_in in copy_ins) >= 2  # the blocks' buckets
    for scatter in collective_nodes(backward.graph, REDUCE_SCATTER):
        assert scatter.args[0].meta["val"].dtype == torch.float32
    assert pass_counters["bucket.gave_up"] == 0


@pytest.mark.parametrize("choice", ["ops", "inductor"])
def test_bucket_copy_choice_decides_between_the_extern_copy_ops_and_a_cat_inductor_fuses(fake_world, choice):
    policy = fsdp_compile.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    forward, _ = _graphs(PassConfig(reorder=False, bucket_copy=choice), mp_policy=policy)
    targets = Counter(node.target for node in forward.graph.nodes)
    copy_ins = [gather.args[0] for gather in collective_nodes(forward.graph, ALL_GATHER)]
    if choice == "ops":
        assert targets[COPY_IN] >= 2 and targets[COPY_OUT] >= 2, targets
    else:  # the same buckets, written by a cat of per-parameter casts Inductor fuses into one kernel
        assert targets[COPY_IN] == 0 and targets[COPY_OUT] == 0, targets
        assert sum(copy_in.target is torch.ops.aten.cat.default for copy_in in copy_ins) >= 2
    assert len(copy_ins) == 3 and all(copy_in.meta["val"].dtype == torch.bfloat16 for copy_in in copy_ins)
    assert pass_counters["bucket.gave_up"] == 0


def test_bucket_copy_auto_is_the_extern_ops_on_cpu_and_an_unknown_choice_is_refused():
    assert PassConfig().bucket_copy_for(torch.device("cpu")) == "ops"
    assert PassConfig(bucket_copy="inductor").bucket_copy_for(torch.device("cpu")) == "inductor"
    with pytest.raises(ValueError, match="bucket_copy='triton'.*auto, ops, inductor"):
        PassConfig(bucket_copy="triton")


def test_merge_small_groups_under_a_byte_cap(fake_world):
    forward, backward = _graphs(PassConfig(reorder=False, merge_small_groups_bytes=1 << 40))
    assert len(collective_nodes(forward.graph, ALL_GATHER)) == 1
    assert set(_groups(collective_nodes(forward.graph, ALL_GATHER))[0].split("+")) == GROUPS
    assert len(collective_nodes(backward.graph, REDUCE_SCATTER)) == 1
    forward, _ = _graphs(PassConfig(reorder=False, merge_small_groups_bytes=1))
    assert len(collective_nodes(forward.graph, ALL_GATHER)) == 3
    assert pass_counters["bucket.gave_up"] == 0


def test_hsdp_all_reduces_are_bucketed_per_group():
    pass_counters.clear()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    torch._dynamo.reset()
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
        _, backward = _graphs(PassConfig(reorder=False), mesh=mesh)
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()
    assert len(collective_nodes(backward.graph, REDUCE_SCATTER)) == 3
    assert len(collective_nodes(backward.graph, ALL_REDUCE)) == 3
    assert pass_counters["bucket.gave_up"] == 0


@pytest.mark.parametrize("fake_world", [8], indirect=True)  # a new trace; agreeing is not about scale
def test_bucketing_yields_the_same_graph_every_time(fake_world):
    # Two traces: the shared one (passes on a copy) and a new one, bucketed by the backend.
    first, first_backward = _graphs(PassConfig(reorder=False))
    _, second, second_backward = _trace(PassConfig(reorder=False))
    assert _program(first) == _program(second)
    assert _program(first_backward) == _program(second_backward)


def test_graphs_with_the_same_program_are_told_apart_by_order_not_by_names():
    def graph(names: tuple[str, str], swapped: bool = False) -> fx.GraphModule:
        graph = fx.Graph()
        x = graph.placeholder("x")
        first = graph.call_function(torch.ops.aten.neg.default, (x,), name=names[0])
        second = graph.call_function(torch.ops.aten.relu.default, (x,), name=names[1])
        graph.output((first, second))
        if swapped:
            first.prepend(second)
        return fx.GraphModule(torch.nn.Module(), graph)

    assert graph(("neg", "relu")).code != graph(("neg_2", "relu_3")).code
    assert _program(graph(("neg", "relu"))) == _program(graph(("neg_2", "relu_3")))
    assert _program(graph(("neg", "relu"))) != _program(graph(("neg", "relu"), swapped=True))


@pytest.mark.parametrize("name, run", [("bucket", bucket_collectives), ("reorder", reorder_collectives)])
def test_a_pass_that_leaves_a_collective_alone_counts_it(name, run):
    """The counters the tests assert to be zero do count: an annotated all-gather whose result is
    also read past its wait can be neither bucketed nor moved."""
    graph = fx.Graph()
    gathered = graph.call_function(ALL_GATHER, (graph.placeholder("shard"), 8, "0"))
    gathered.meta["custom"] = {FSDP_ANNOTATION_KEY: True, GROUP_KEY: "layers.0"}
    graph.output((graph.call_function(WAIT, (gathered,)), gathered))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    before = gm.code
    pass_counters.clear()
    run(gm, PassConfig())
    assert pass_counters[f"{name}.gave_up"] == 1
    assert gm.code == before


def test_a_collective_waited_on_twice_is_read_through_its_first_wait():
    """[Note: one wait per collective] in passes/graph.py: torch 2.14 keeps the two waits of a tied
    parameter's all-gather that torch 2.13's CSE merged; every reader then reads the first wait."""
    graph = fx.Graph()
    gathered = graph.call_function(ALL_GATHER, (graph.placeholder("shard"), 8, "0"))
    first = graph.call_function(WAIT, (gathered,))
    head = graph.call_function(torch.ops.aten.t.default, (graph.call_function(WAIT, (gathered,)),))
    graph.output((first, head))
    assert one_wait_per_collective(graph) == 1
    assert list(gathered.users) == [first] and head.args[0] is first
    assert one_wait_per_collective(graph) == 0


def test_a_cast_is_told_by_what_it_changes_not_by_its_spelling():
    """``is_cast`` (passes/graph.py): torch 2.13 traces ``.to(dtype)`` as prims.convert_element_type,
    torch 2.14 as aten._to_copy; a _to_copy that moves the tensor elsewhere is no cast."""
    graph = fx.Graph()
    shard = graph.placeholder("shard")
    shard.meta["val"] = torch.empty(4, device="meta")
    prims = graph.call_function(torch.ops.prims.convert_element_type.default, (shard, torch.bfloat16))
    to_copy = graph.call_function(torch.ops.aten._to_copy.default, (shard,), {"dtype": torch.bfloat16, "device": torch.device("meta")})
    moved = graph.call_function(torch.ops.aten._to_copy.default, (shard,), {"dtype": torch.bfloat16, "device": torch.device("cpu")})
    pinned = graph.call_function(torch.ops.aten._to_copy.default, (shard,), {"dtype": torch.bfloat16, "pin_memory": True})
    assert [is_cast(node) for node in (prims, to_copy, moved, pinned)] == [True, True, False, False]


def test_a_tied_parameter_crosses_the_wire_once_in_its_groups_reduce_scatter(fake_world):
    """[Note: a tied parameter's one reduction] in passes/bucket.py: the tied embedding/head weight,
    read under two names, has two gradients; the root's one reduce-scatter carries their sum once
    (as the eager runtime's does), not each of them."""
    model, _, backward = _traced(PassConfig(reorder=False))
    (root_scatter,) = [n for n in collective_nodes(backward.graph, REDUCE_SCATTER) if fsdp_annotation(n)[GROUP_KEY] == "Transformer"]
    root_params = model._fsdp_state().group.fsdp_params
    assert "tok_embeddings.weight" in {p.fqn for p in root_params}
    assert root_scatter.args[0].meta["val"].numel() == fake_world * sum(p.padded_shard_numel for p in root_params)
    assert pass_counters["bucket.gave_up"] == 0
