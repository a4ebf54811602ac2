"""passes/recompute.deliver_frame_reductions_late on small hand-built backward graphs, in one process:
which reduce-scatters of a block frame leave the graph in flight and which stay waited in it
([Note: late reduce-scatter wait across block frames] in fsdp_compile/module.py)."""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fsdp_compile.passes.graph import (
    BLOCK_FRAME_TOKEN, DELIVER_GRADIENT, DELIVER_REDUCE_SCATTER_LATE, FSDP_ANNOTATION_KEY, GROUP_KEY, REDUCE_SCATTER, STATE_KEY, WAIT,
    new_node, pass_counters,
)
from fsdp_compile.passes.recompute import deliver_frame_reductions_late

_aten = torch.ops.aten


def _frame_backward(slices: list[tuple[int, int]], state_token: int = BLOCK_FRAME_TOKEN, foreign_reader: bool = False):
    """A block frame's backward as the bucket pass leaves it: a 16-element gradient bucket
    reduce-scattered over 2 ranks, each ``(start, end)`` column range of the 8 reduced elements
    divided and delivered with a sink of its own; ``foreign_reader``: the graph also returns a sum
    of the reduced shard."""
    graph = fx.Graph()
    with FakeTensorMode():
        values = {"grad": torch.empty(16)} | {f"sink{i}": torch.empty(1) for i in range(len(slices))}
    placeholders = {}
    for name, value in values.items():
        placeholders[name] = graph.placeholder(name)
        placeholders[name].meta["val"] = value
    annotation = {FSDP_ANNOTATION_KEY: True, GROUP_KEY: "Block (block frame)", STATE_KEY: state_token}
    reduce_scatter = new_node(graph, REDUCE_SCATTER, (placeholders["grad"], "sum", 2, "0"), annotation)
    wait = new_node(graph, WAIT, (reduce_scatter,), annotation)
    outputs = []
    for index, (start, end) in enumerate(slices):
        piece = new_node(graph, _aten.slice.Tensor, (wait, 0, start, end), annotation)
        divided = new_node(graph, _aten.div.Tensor, (piece, 2.0), annotation)
        outputs.append(new_node(graph, DELIVER_GRADIENT, (divided, placeholders[f"sink{index}"]), annotation))
    if foreign_reader:
        outputs.append(new_node(graph, _aten.sum.default, (wait,), None))
    graph.output(tuple(outputs))
    return graph


def _calls(graph: fx.Graph, target: object) -> list[fx.Node]:
    return graph.find_nodes(op="call_function", target=target)


def test_a_frame_bucket_read_only_by_its_deliveries_is_handed_over_in_flight_at_the_graph_end():
    graph = _frame_backward([(4, 8), (0, 4)])
    assert deliver_frame_reductions_late(graph) == 1
    handed = _calls(graph, DELIVER_REDUCE_SCATTER_LATE)
    assert len(handed) == 1 and not _calls(graph, WAIT) and not _calls(graph, DELIVER_GRADIENT)
    in_flight, reduce_input, sinks = handed[0].args
    assert in_flight.target is REDUCE_SCATTER and reduce_input.name == "grad"
    assert [sink.name for sink in sinks] == ["sink1", "sink0"]  # in the bucket's column order
    nodes = list(graph.nodes)
    assert nodes[-2] is handed[0]  # the last call: Inductor allocates nothing after it
    assert all(output is handed[0] for output in nodes[-1].args[0])  # each sink's gradient
    graph.lint()


def test_a_frame_bucket_read_by_anything_else_stays_waited_in_the_graph_and_is_counted():
    pass_counters.clear()
    for graph in (_frame_backward([(0, 4), (4, 8)], foreign_reader=True), _frame_backward([(0, 4)])):
        assert deliver_frame_reductions_late(graph) == 0
        assert len(_calls(graph, WAIT)) == 1 and len(_calls(graph, DELIVER_GRADIENT)) >= 1
        assert not _calls(graph, DELIVER_REDUCE_SCATTER_LATE)
    # The foreign reader, and the half of the shard no parameter takes.
    assert pass_counters["deliver_late.gave_up"] == 2


def test_a_reduce_scatter_outside_block_frames_is_left_alone_without_a_word():
    pass_counters.clear()
    graph = _frame_backward([(0, 4), (4, 8)], state_token=3)  # a group's own token: not a block frame
    assert deliver_frame_reductions_late(graph) == 0
    assert len(_calls(graph, WAIT)) == 1
    assert pass_counters["deliver_late.gave_up"] == 0
