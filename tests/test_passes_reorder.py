"""passes/reorder.py: the documented schedule, the in-flight budget, determinism, Inductor keeping
the order, FSDP_COMPILE_DUMP and its timeline's figures, and numerics at world size 2 under
non-default schedules."""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

import fsdp_compile
from fsdp_compile.config import PassConfig
from fsdp_compile.passes.dump import collective_timeline
from fsdp_compile.passes.graph import (
    ALL_GATHER, ALL_REDUCE, COLLECTIVES, FRAME_GATHER, GROUP_KEY, REDUCE_SCATTER, WAIT, collective_bytes, collective_nodes,
    fsdp_annotation, inflight_bytes, inflight_collectives, max_inflight_bytes, pass_counters,
)
from test_passes_bucket import CONFIG, _graphs, _trace, _program

_SHORT = {ALL_GATHER: "AG", REDUCE_SCATTER: "RS"}


def _event(node: fx.Node) -> str | None:
    """"issue AG layers.0" / "wait RS Transformer" for a collective or its wait, else None."""
    if node.target in _SHORT:
        return f"issue {_SHORT[node.target]} {fsdp_annotation(node)[GROUP_KEY]}"
    if node.target is WAIT and node.args[0].target in _SHORT:
        return f"wait {_SHORT[node.args[0].target]} {fsdp_annotation(node.args[0])[GROUP_KEY]}"
    return None


def _events(graph: fx.Graph) -> list[str]:
    return [event for event in map(_event, graph.nodes) if event is not None]


def _matmuls(graph: fx.Graph, node: fx.Node) -> int:
    """mm nodes ``node`` runs: itself, or the body of a block's nested region it calls."""
    if node.target is torch.ops.higher_order.invoke_subgraph:
        body = getattr(graph.owning_module, node.args[0].target).graph
        return sum(_matmuls(body, inner) for inner in body.nodes)
    return int(node.target is torch.ops.aten.mm.default)


def _matmuls_between(graph: fx.Graph, first: str, second: str) -> int:
    """How many mm nodes run between two events of ``_events`` (inside block regions too)."""
    inside, count = False, 0
    for node in graph.nodes:
        event = _event(node)
        if event == first:
            inside = True
        elif event == second:
            return count
        elif inside:
            count += _matmuls(graph, node)
    raise AssertionError(f"{first!r} then {second!r} not found")


def test_forward_prefetches_the_next_group_before_the_current_compute(fake_world):
    forward, _ = _graphs(PassConfig(prefetch_depth=1))
    assert _events(forward.graph) == [
        "issue AG Transformer", "wait AG Transformer",
        "issue AG layers.0", "wait AG layers.0",
        "issue AG layers.1", "wait AG layers.1",
    ]
    # layers.1's gather is in flight during all of layers.0's matmuls (q, k, v, o, w1, w3, w2).
    assert _matmuls_between(forward.graph, "issue AG layers.1", "wait AG layers.1") == 7
    assert _matmuls_between(forward.graph, "wait AG layers.0", "issue AG layers.1") == 0
    assert pass_counters["bucket.gave_up"] == pass_counters["reorder.gave_up"] == 0


def test_backward_prefetches_regathers_and_waits_on_reduce_scatters_late(fake_world):
    _, backward = _graphs(PassConfig(prefetch_depth=1))
    assert _events(backward.graph) == [
        "issue AG layers.1", "wait AG layers.1",
        "issue AG layers.0",                       # prefetched during layers.1's backward
        "issue RS layers.1",                       # right after layers.1's last gradient
        "wait AG layers.0",
        "issue RS layers.0", "wait RS layers.1",   # one reduce-scatter left in flight
        "issue RS Transformer", "wait RS layers.0",
        "wait RS Transformer",                     # right before the graph returns
    ]
    assert _matmuls_between(backward.graph, "issue AG layers.0", "wait AG layers.0") > 0
    assert _matmuls_between(backward.graph, "issue RS layers.1", "wait RS layers.1") > 0  # layers.0 backward
    last_wait = [n for n in backward.graph.nodes if n.target is WAIT][-1]
    between = list(backward.graph.nodes)[list(backward.graph.nodes).index(last_wait):]
    assert not any(_matmuls(backward.graph, n) for n in between)
    assert pass_counters["bucket.gave_up"] == pass_counters["reorder.gave_up"] == 0


def test_depth_two_and_depth_zero(fake_world):
    forward, _ = _graphs(PassConfig(prefetch_depth=2))
    assert _events(forward.graph) == [
        "issue AG Transformer", "issue AG layers.0", "wait AG Transformer",
        "issue AG layers.1", "wait AG layers.0", "wait AG layers.1",
    ]
    forward, backward = _graphs(PassConfig(prefetch_depth=0))
    for graph in (forward.graph, backward.graph):
        events = _events(graph)
        # No overlap: every issue is followed by its own wait, with no matmul in between.
        for issue, wait in zip(events[::2], events[1::2]):
            assert wait == issue.replace("issue", "wait")
            assert _matmuls_between(graph, issue, wait) == 0


def _largest_collective(graph: fx.Graph) -> int:
    return max(collective_bytes(n) for n in (*collective_nodes(graph, ALL_GATHER), *collective_nodes(graph, REDUCE_SCATTER)))


def test_inflight_bytes_never_exceed_the_budget(fake_world):
    forward, backward = _graphs(PassConfig(prefetch_depth=3))
    largest = max(_largest_collective(forward.graph), _largest_collective(backward.graph))
    unbounded = max(max_inflight_bytes(forward.graph), max_inflight_bytes(backward.graph))
    assert unbounded > largest  # depth 3 without a budget overlaps several buckets
    for budget in (0, largest, largest + largest // 2, 2 * largest):
        forward, backward = _graphs(PassConfig(prefetch_depth=3, max_inflight_bytes=budget))
        for graph in (forward.graph, backward.graph):
            _assert_within_budget(graph, budget)
        if budget < 2 * _largest_collective(forward.graph):
            # At most one gathered bucket in flight: layers.1 is not prefetched over layers.0's wait.
            events = _events(forward.graph)
            assert events.index("issue AG layers.1") > events.index("wait AG layers.0")


def _assert_within_budget(graph: fx.Graph, budget: int) -> None:
    for node, flying in inflight_collectives(graph):
        # A single collective larger than the budget may fly, alone.
        assert sum(flying.values()) <= budget or len(flying) == 1, (budget, node.name, flying)


@pytest.mark.parametrize("fake_world", [8], indirect=True)  # a new trace; agreeing is not about scale
def test_the_same_graph_yields_the_same_schedule(fake_world):
    config = PassConfig(prefetch_depth=2, max_inflight_bytes=100_000)
    # Two traces: the shared one (passes on a copy) and a new one, reordered by the backend.
    first, first_backward = _graphs(config)
    _, second, second_backward = _trace(config)
    # Compared without names: see [Note: graphs compared without names] in test_passes_bucket.py.
    assert _program(first) == _program(second)
    assert _program(first_backward) == _program(second_backward)


def _hsdp_graphs(passes: PassConfig):
    """(forward, backward) on a 2 x 4 (replicate, shard) mesh of 8 fake ranks, give-up counters cleared."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    pass_counters.clear()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    torch._dynamo.reset()
    try:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
        return _graphs(passes, mesh=mesh)
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


def test_hsdp_schedule_keeps_each_all_reduce_behind_its_reduce_scatter():
    _, backward = _hsdp_graphs(PassConfig(prefetch_depth=1))
    nodes = list(backward.graph.nodes)
    for scatter in collective_nodes(backward.graph, REDUCE_SCATTER):
        wait = next(iter(scatter.users))
        all_reduce = next(u for u in wait.users if u.target is ALL_REDUCE)
        assert nodes.index(all_reduce) == nodes.index(wait) + 1
    assert pass_counters["bucket.gave_up"] == pass_counters["reorder.gave_up"] == 0


def test_hsdp_all_reduces_count_against_the_budget():
    _, unbounded = _hsdp_graphs(PassConfig(prefetch_depth=3))
    # The all-reduces are in flight, and counted: at each one's issue the total includes its bytes.
    totals = dict(inflight_bytes(unbounded.graph))
    all_reduces = collective_nodes(unbounded.graph, ALL_REDUCE)
    assert all_reduces and all(totals[n] >= collective_bytes(n) > 0 for n in all_reduces)
    budget = _largest_collective(unbounded.graph)
    _, backward = _hsdp_graphs(PassConfig(prefetch_depth=3, max_inflight_bytes=budget))
    _assert_within_budget(backward.graph, budget)
    assert max_inflight_bytes(backward.graph) < max_inflight_bytes(unbounded.graph)


def _timeline_figures(gm: fx.GraphModule):
    """(node, bytes its issue line prints or None, in-flight total printed) per line of its timeline."""
    nodes = list(gm.graph.nodes)
    for line in collective_timeline(gm).splitlines():
        issued = re.search(r" issue\s+\S+\s+\S+\s+(\d+) B ", line)
        total = re.search(r"in flight: .*\((\d+) B\)$", line)
        yield nodes[int(line.split()[0])], int(issued.group(1)) if issued else None, int(total.group(1)) if total else 0


def test_timeline_prints_the_bytes_the_budget_counts():
    """HSDP, bucketed: all-gathers, reduce-scatters and all-reduces each print ``collective_bytes``,
    and every line's in-flight total is ``inflight_bytes`` at that node."""
    forward, backward = _hsdp_graphs(PassConfig(prefetch_depth=1))
    for gm in (forward, backward):
        totals = dict(inflight_bytes(gm.graph))
        printed = {}
        for node, issued, total in _timeline_figures(gm):
            assert total == totals[node], node.name
            if issued is not None:
                printed[node] = issued
        collectives = [n for n in gm.graph.nodes if n.target in COLLECTIVES]
        assert printed == {n: collective_bytes(n) for n in collectives}
    # A reduce-scatter prints what it holds until its wait: its input, world (4) times its output.
    scatter = collective_nodes(backward.graph, REDUCE_SCATTER)[0]
    assert printed[scatter] == 4 * scatter.meta["val"].numel() * scatter.meta["val"].element_size()
    assert collective_nodes(backward.graph, ALL_REDUCE)[0] in printed


def test_inductor_keeps_the_prefetch_order():
    """The generated forward issues layers.1's all-gather before layers.0's matmuls (world 8 only:
    Inductor's compile takes ~10 s)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_compile.models import Transformer

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    torch._dynamo.reset()
    try:
        forward_code = _inductor_forward_code(Transformer)
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()
    # A block compiled once is a function of its own (``def partitioned_fw_subgraph_0_0(args):``),
    # called from ``call``: a call stands for the matmuls of its body.
    bodies = dict(re.findall(r"\ndef (\w+)\(args\):\n(.*?)(?=\n(?:def|class) )", forward_code, re.S))
    body_matmuls = {name: body.count("extern_kernels.mm(") for name, body in bodies.items()}
    main = forward_code[forward_code.index("    def call(self, args):"):]
    names = "|".join(map(re.escape, body_matmuls)) or "(?!)"
    calls = re.findall(
        rf"_c10d_functional\.(all_gather_into_tensor|wait_tensor)\.default\(|extern_kernels\.(mm)\(|= ({names})\(", main
    )
    sequence = [
        item for gather, mm, region in calls for item in ([gather or mm] if not region else ["mm"] * body_matmuls[region])
    ]
    gathers = [i for i, call in enumerate(sequence) if call == "all_gather_into_tensor"]
    waits = [i for i, call in enumerate(sequence) if call == "wait_tensor"]
    assert len(gathers) == 3 and len(waits) == 3
    assert sequence[gathers[2]:waits[2]].count("mm") == 7  # layers.0's matmuls under layers.1's gather


def _inductor_forward_code(model_class) -> str:
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = model_class(CONFIG)
    for layer in model.layers:
        fsdp_compile.fully_shard(layer)
    fsdp_compile.fully_shard(model)
    previous, fsdp_compile.config.passes = fsdp_compile.config.passes, PassConfig(prefetch_depth=1)
    try:
        compiled = torch.compile(model, backend="fsdp_inductor", fullgraph=True)
        tokens = torch.randint(0, CONFIG.vocab_size, (2, 8))
        # The training forward (the parameters require grad); AOTAutograd compiles the backward
        # lazily, at the first backward, which this test has no use for.
        _, (forward_code, *_) = run_and_get_code(lambda: compiled(tokens))
    finally:
        fsdp_compile.config.passes = previous
    return forward_code


def test_dump_writes_graphs_and_timelines_for_each_pass(fake_world, tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_COMPILE_DUMP", str(tmp_path))
    _graphs(PassConfig(prefetch_depth=1))
    names = sorted(p.name for p in tmp_path.iterdir())
    for kind in ("forward", "backward"):
        for stage in ("0-input", "1-after-bucket", "2-after-reorder"):
            assert any(n.endswith(f"-{kind}-{stage}.py") for n in names), (kind, stage)
            assert any(n.endswith(f"-{kind}-{stage}.timeline.txt") for n in names), (kind, stage)
    def largest(pattern: str) -> str:  # the model's forward, not the small graph of the loss
        return max((p.read_text() for p in tmp_path.glob(pattern)), key=len)

    before = largest("*-forward-1-after-bucket.timeline.txt")
    after = largest("*-forward-2-after-reorder.timeline.txt")
    # After reordering, matmuls run while layers.1's bucket is in flight; before, none do.
    assert re.search(r"comp\s+mm\s.*in flight: layers\.1", after)
    assert not re.search(r"comp\s+mm\s.*in flight: [^-\s]", before)
    graph_text = largest("*-forward-2-after-reorder.py")
    assert "all_gather_into_tensor" in graph_text


def _reordered_training_matches_eager(depth: int, budget: int | None):
    from test_compile import _compiled_vs_eager

    previous = fsdp_compile.config.passes
    fsdp_compile.config.passes = PassConfig(prefetch_depth=depth, max_inflight_bytes=budget)
    try:
        return _compiled_vs_eager("fsdp_inductor", backend="fsdp_aot_eager")
    finally:
        fsdp_compile.config.passes = previous


def test_deeper_prefetch_under_a_budget_trains_like_eager(dist):
    """Default schedule: tests/test_compile.py; here depth 2 with a budget of about one block."""
    from test_compile import _assert_matches_eager

    # test_compile trains the UNEVEN model: a block gathers about 21 kB in fp32.
    for result in dist.run(2, _reordered_training_matches_eager, 2, 24_000):
        _assert_matches_eager(result)


def test_backends_with_different_passes_never_share_graphs():
    """Two models of one class in one process, compiled with ``fsdp_inductor_with`` and other
    passes, each get their own graph (the benchmark's pass-ablation modes rely on it)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_compile.compile.backend import fsdp_inductor_with, observe_graphs
    from fsdp_compile.models import Transformer

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    torch._dynamo.reset()
    gathers, forward_graphs = [], []
    try:
        for passes in (PassConfig(bucket=False, reorder=False), PassConfig()):
            torch.manual_seed(0)
            model = Transformer(CONFIG)
            for layer in model.layers:
                fsdp_compile.fully_shard(layer)
            fsdp_compile.fully_shard(model)
            # Forward only: one Inductor compile each (observe_graphs turns the compile caches off).
            with torch.no_grad(), observe_graphs() as graphs:
                torch.compile(model, backend=fsdp_inductor_with(passes))(torch.randint(0, CONFIG.vocab_size, (2, 8)))
            # Every forward graph: the outer one holds the collectives, the blocks' bodies none.
            # A block frame's all-gather is one frame_all_gather call ([Note: prefetch across block
            # frames] in module.py): an all-gather still.
            gathers.append(sum(len(collective_nodes(g.graph, op)) for kind, g in graphs if kind == "forward" for op in (ALL_GATHER, FRAME_GATHER)))
            forward_graphs.append(sum(kind == "forward" for kind, _ in graphs))
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()
    # Per parameter, then one per group: the blocks' and the root's as one graph; blocks compiled as
    # frames (the default): the root's graph and the one frame graph every block runs, one each.
    assert gathers[0] > gathers[1] == (2 if fsdp_compile.config.block_compile_is("frames") else 3), gathers
    assert forward_graphs[0] == forward_graphs[1] > 0, forward_graphs  # the second model reused none
