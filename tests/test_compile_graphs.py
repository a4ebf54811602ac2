"""Traced graphs of the compiled path, in one process with a fake process group (world 8 and 64)."""
from __future__ import annotations

import operator

import pytest
import torch

import fsdp_compile
from fsdp_compile.compile.graph_check import collective_fingerprint
from fsdp_compile.passes.graph import GROUP_KEY, PARAM_KEY, fsdp_annotation, pass_counters
from test_passes_bucket import _traced


def _ops(graph_module, name):
    return [n for n in graph_module.graph.nodes if n.op == "call_function" and name in str(n.target)]


def _traced_graphs(reshard_root=None, passes=None):
    """(model, forward, backward) of test_passes_bucket.py's model, passes ``passes`` (default:
    ``fsdp_compile.config.passes``), as fsdp_aot_eager compiles them; one trace per world size and
    ``reshard_root`` (see [Note: traced once, passes on copies] there)."""
    return _traced(passes or fsdp_compile.config.passes, reshard_root=reshard_root)


def test_graphs_hold_one_all_gather_per_parameter_and_one_reduce_scatter_per_read(fake_world):
    # The graphs as traced, before bucketing (tests/test_passes_bucket.py covers the bucketed ones).
    model, forward, backward = _traced_graphs(passes=fsdp_compile.config.PassConfig(bucket=False, reorder=False))
    params = list(model.parameters())
    gathers = _ops(forward, "all_gather_into_tensor")
    scatters = _ops(backward, "reduce_scatter_tensor")
    # The tied embedding/head weight is read twice: its two identical all-gathers are merged
    # (CSE), its two gradients are reduced separately and accumulate into one .grad.
    assert len(gathers) == len(params)
    assert len(scatters) == len(params) + 1
    for node in gathers + scatters:
        annotation = fsdp_annotation(node)
        assert annotation is not None, node
        assert annotation[GROUP_KEY] in {"Transformer", "layers.0", "layers.1"}
    gathered = {fsdp_annotation(n)[PARAM_KEY] for n in gathers}
    assert "layers.0" in {fsdp_annotation(n)[GROUP_KEY] for n in gathers}
    assert {"tok_embeddings.weight", "attention.wq.weight", "feed_forward.w2.weight"} <= gathered
    assert all(n.args[1] == fake_world for n in gathers)  # group size argument


def _saved_all_gather_outputs(forward):
    """Saved-for-backward values that are (views of) all-gathered parameters, by group."""
    output = next(n for n in forward.graph.nodes if n.op == "output")
    saved = output.args[0][1:]
    groups = []
    for value in saved:
        node = value
        # A saved view of a gathered parameter keeps the whole parameter alive: look through views,
        # and through the getitem that takes a parameter out of its bucket's copy-out.
        while node.op == "call_function" and (
            (fsdp_annotation(node) is None and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view)
            or node.target is operator.getitem
        ):
            node = node.args[0]
        annotation = fsdp_annotation(node) if node.op == "call_function" else None
        # The chain from the gather on ("all_gather" names the copy-out op too).
        unsharded = ("all_gather", "wait_tensor", "slice", "narrow")
        if annotation is not None and any(name in str(node.target) for name in unsharded):
            groups.append(annotation[GROUP_KEY])
    return groups


def test_reshard_after_forward_groups_re_all_gather_instead_of_saving(fake_world):
    _, forward, backward = _traced_graphs()
    saved = _saved_all_gather_outputs(forward)
    # Blocks reshard after forward: nothing of theirs is saved, backward gathers them again.
    assert not [g for g in saved if g.startswith("layers.")]
    regathered = {fsdp_annotation(n)[GROUP_KEY] for n in _ops(backward, "all_gather_into_tensor")}
    assert regathered == {"layers.0", "layers.1"}
    # The root keeps its parameters (reshard_after_forward=None means False for the root): saved.
    assert "Transformer" in saved
    # The default passes ran on these graphs (bucket, reorder) and took every group.
    assert pass_counters["bucket.gave_up"] == pass_counters["reorder.gave_up"] == pass_counters["recompute.gave_up"] == 0


@pytest.mark.parametrize("fake_world", [8], indirect=True)  # a trace of its own; what is saved is not about scale
def test_root_with_reshard_after_forward_true_saves_nothing_unsharded(fake_world):
    _, forward, backward = _traced_graphs(reshard_root=True)
    assert _saved_all_gather_outputs(forward) == []
    regathered = {fsdp_annotation(n)[GROUP_KEY] for n in _ops(backward, "all_gather_into_tensor")}
    assert regathered == {"Transformer", "layers.0", "layers.1"}
    assert pass_counters["bucket.gave_up"] == pass_counters["reorder.gave_up"] == pass_counters["recompute.gave_up"] == 0


def _graph(*ops: str, sub: torch.fx.GraphModule | None = None) -> torch.fx.GraphModule:
    """A graph of ``ops`` ("ag": an all-gather of 8 ranks, "rs": a reduce-scatter, "relu"), by hand."""
    graph = torch.fx.Graph()
    value = graph.placeholder("x")
    root = torch.nn.Module()
    if sub is not None:
        root.body = sub
        graph.get_attr("body")
    c10d = torch.ops._c10d_functional
    for op in ops:
        if op == "ag":
            value = graph.call_function(c10d.wait_tensor.default, (graph.call_function(c10d.all_gather_into_tensor.default, (value, 8, "0")),))
        elif op == "rs":
            value = graph.call_function(c10d.reduce_scatter_tensor.default, (value, "sum", 8, "0"))
        else:
            value = graph.call_function(torch.ops.aten.relu.default, (value,))
    graph.output(value)
    return torch.fx.GraphModule(root, graph)


def test_collective_fingerprint_sees_collectives_only():
    # Ranks may trace other shapes or other non-collective ops (per-rank batches, dynamic shapes).
    assert collective_fingerprint(_graph("relu", "ag", "relu")) == collective_fingerprint(_graph("ag"))
    # A different collective, a missing one or a reordering is what would hang.
    assert collective_fingerprint(_graph("ag")) != collective_fingerprint(_graph("ag", "ag"))
    assert collective_fingerprint(_graph("ag", "rs")) != collective_fingerprint(_graph("rs", "ag"))
    # Collectives inside subgraphs (an autograd function's backward body) count too.
    assert collective_fingerprint(_graph("ag", sub=_graph("rs"))) != collective_fingerprint(_graph("ag"))


def _one_rank_compiles_a_graph_the_other_runs_eagerly() -> tuple[float, str]:
    """Rank 1 alone checks a graph, as where Dynamo compiles a frame on one rank and runs it eagerly
    on the other: first one without collectives, then one with an all-gather."""
    import time

    import torch.distributed as dist

    from fsdp_compile import config
    from fsdp_compile.compile.graph_check import check_collectives_match_across_ranks

    if dist.get_rank() != 1:
        return 0.0, ""
    previous, config.graph_check_timeout_s = config.graph_check_timeout_s, 1.0
    try:
        start = time.monotonic()
        check_collectives_match_across_ranks(_graph("relu", "relu"))
        seconds = time.monotonic() - start
        try:
            check_collectives_match_across_ranks(_graph("relu", "ag", "rs"))
        except RuntimeError as error:
            return seconds, str(error)
        return seconds, ""
    finally:
        config.graph_check_timeout_s = previous


def test_a_graph_without_collectives_is_not_awaited_across_ranks(dist):
    """Nothing can hang on a graph without collectives: it is neither published nor awaited (a
    collective-free frame one rank compiled while the other ran it eagerly hung CI for good)."""
    seconds, error = dist.run(2, _one_rank_compiles_a_graph_the_other_runs_eagerly)[1]
    assert seconds < 0.5, seconds
    # A graph with collectives is awaited: the other rank never compiles it, so the wait times out.
    assert "that ranks [0] have not after 1 s" in error, error


@pytest.mark.parametrize("fake_world", [8], indirect=True)
def test_inductor_cache_keys_a_device_mesh_by_what_identifies_it(fake_world):
    """[Note: warm start across processes]: two mesh objects over the same ranks, names and groups
    (a restarted process builds new ones) key a graph alike; another mesh does not."""
    from torch._inductor.codecache import FxGraphCachePickler
    from torch._library.fake_class_registry import FakeScriptObject
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    def key(mesh):
        # The bytes Inductor hashes into the key (get_key in torch 2.13, get_hash in 2.11; dumps in both).
        return FxGraphCachePickler(None).dumps([FakeScriptObject(None, "DeviceMesh", mesh)])

    built = init_device_mesh("cpu", (fake_world,), mesh_dim_names=("dp",))
    again = DeviceMesh("cpu", list(range(fake_world)), mesh_dim_names=("dp",), _init_backend=False)
    again._dim_group_names = list(built._dim_group_names)
    renamed = init_device_mesh("cpu", (fake_world,), mesh_dim_names=("fsdp",))
    assert again is not built and key(again) == key(built)
    assert key(renamed) != key(built)


@pytest.mark.parametrize("fake_world", [8], indirect=True)
def test_dynamo_graph_traces_each_parameter_read_as_one_all_gather_op(fake_world):
    """[Note: the traced all-gather is one op]: Dynamo records one fsdp_compile::all_gather_shard node
    per managed parameter (no autograd.Function to speculate anywhere in the graph or its regions),
    and the backend's decomposition turns each into the functional all-gather the passes read."""
    from fsdp_compile.compile.backend import fsdp_aot_eager, observe_graphs
    from fsdp_testing import TinyLM

    torch._dynamo.reset()
    model = TinyLM()
    for layer in model.layers:
        fsdp_compile.fully_shard(layer)
    fsdp_compile.fully_shard(model)
    dynamo_graphs = []

    def capture(gm, example_inputs):
        dynamo_graphs.append(gm)
        return fsdp_aot_eager(gm, example_inputs)

    with observe_graphs() as graphs:
        torch.compile(model, backend=capture, fullgraph=True)(torch.randint(0, 37, (2, 8))).sum().backward()
    dynamo_graph = dynamo_graphs[0]  # the model's (a second one holds the root's post-forward, no parameter read)
    nodes = [n for gm in dynamo_graph.modules() if isinstance(gm, torch.fx.GraphModule) for n in gm.graph.nodes]
    traced_gathers = [n for n in nodes if n.op == "call_function" and "fsdp_compile.all_gather_shard" in str(n.target)]
    assert len(traced_gathers) == len(list(model.parameters())) == 7
    assert len({(fsdp_annotation(n)[GROUP_KEY], fsdp_annotation(n)[PARAM_KEY]) for n in traced_gathers}) == 7
    assert not [n for n in nodes if n.target is torch.ops.higher_order.autograd_function_apply]
    forward = next(g for kind, g in graphs if kind == "forward")
    # The traced op is decomposed (the passes see the collective); bucketed per group.
    assert not _ops(forward, "all_gather_shard") and len(_ops(forward, "all_gather_into_tensor")) == 3
