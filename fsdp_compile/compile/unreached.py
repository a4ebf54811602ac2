"""Gradients a compiled graph computes for parameters that eager autograd would never reach.

[Note: a graph output left out of the loss]
Eagerly, a parameter whose outputs never reach the loss gets no gradient: autograd never visits
it, so its ``.grad`` stays as it was (None after ``zero_grad()``) and the optimizer skips it. A
compiled graph's backward is one autograd node for all of its outputs, and autograd hands that node
zeros for an output that got no gradient: the graph then reduce-scatters a zero gradient into the
parameter's ``.grad``, and Adam moves the parameter through its moments (FSDP2's own test of a
model with two outputs, the second left out of the loss after three steps, drifted by 3.6e-2).

So the FSDP backends wrap each compiled forward: ``OutputReach`` (read from the Dynamo graph at
compile time) lists the graph inputs that feed a managed parameter's traced read (the parameter,
or the sink its gradient goes to) and the outputs each of them reaches. At run time a hook on those
outputs sees which got a gradient; at the end of the backward every such input that reached none,
in none of the graphs it was read in, gets back the ``.grad`` of None it had before, after the late
reduce-scatters have landed (``GradientDelivery.land_pending``). An input whose ``.grad`` held something
keeps it: adding the zeros changed nothing. The collectives are those of the graph either way.
An unsharded parameter a graph returns (a group gathered in a graph of its own for the graphs and
eager code after it) counts as no output: eager code that reads it delivers its gradient by the
eager hooks, not through this graph, so only uses inside the graph are counted.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.autograd.graph import register_multi_grad_hook

from fsdp_compile.annotations import fsdp_annotation

__all__ = ["OutputReach", "GradientDelivery", "output_reach", "forget_unreached_gradients"]


@dataclasses.dataclass(frozen=True)
class GradientDelivery:
    """What of the runtime's gradient delivery this module needs, handed in by the backend (so that
    it imports no runtime module): the tensor whose ``.grad`` a graph input's gradient ends in, and
    landing the reduce-scatters still in flight (which write ``.grad`` when they land)."""

    holder_of: Callable[[torch.Tensor], torch.Tensor]
    land_pending: Callable[[], None]


@dataclasses.dataclass(frozen=True)
class OutputReach:
    """Per graph input that feeds a managed parameter's read: its position and the output positions
    it reaches (see [Note: a graph output left out of the loss])."""

    inputs: tuple[tuple[int, frozenset[int]], ...]
    outputs: frozenset[int] = dataclasses.field(init=False)  # every output some input reaches

    def __post_init__(self) -> None:
        # Once per compile, not per graph call: the wrapper reads it on every forward.
        object.__setattr__(self, "outputs", frozenset().union(*(reached for _, reached in self.inputs)))


def output_reach(gm: fx.GraphModule) -> OutputReach | None:
    """The graph inputs read by the managed parameters' traced unshards and the outputs each reaches;
    None where the graph reads no managed parameter."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    position = {node: index for index, node in enumerate(placeholders)}
    feeding: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if fsdp_annotation(node) is not None:
            feeding.update(arg for arg in node.all_input_nodes if arg in position)
    if not feeding:
        return None
    bit = {node: 1 << index for index, node in enumerate(sorted(feeding, key=position.__getitem__))}
    sources: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        mask = bit.get(node, 0)
        for arg in node.all_input_nodes:
            mask |= sources.get(arg, 0)
        sources[node] = mask
    output = next(node for node in reversed(gm.graph.nodes) if node.op == "output")
    results = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    # An unsharded parameter the graph hands out (a group gathered in a graph of its own, read by the
    # graphs and eager code after it) is no use of the parameter here: whoever reads it may be eager
    # code, whose gradient autograd does not route through this graph's output.
    result_masks = [
        sources.get(result, 0) if isinstance(result, fx.Node) and fsdp_annotation(result) is None else 0 for result in results
    ]
    inputs = []
    for node, node_bit in bit.items():
        reached = frozenset(index for index, mask in enumerate(result_masks) if mask & node_bit)
        if reached:
            inputs.append((position[node], reached))
    return OutputReach(tuple(inputs)) if inputs else None


class _BackwardRecord:
    """What the graphs of one backward learned: the gradient holders an output of theirs reached, and
    those none did, with whether their ``.grad`` was None before."""

    def __init__(self, graph_task: int, delivery: GradientDelivery) -> None:
        self.graph_task = graph_task
        self.delivery = delivery
        self.reached: set[int] = set()
        self.unreached: dict[int, tuple[torch.Tensor, bool]] = {}

    def forget(self) -> None:
        self.delivery.land_pending()
        for key, (holder, was_none) in self.unreached.items():
            if was_none and key not in self.reached:
                holder.grad = None


class _Backwards:
    """The record of the backward running now (one at a time: autograd runs them one by one)."""

    current: _BackwardRecord | None = None

    @classmethod
    def record(cls, delivery: GradientDelivery) -> _BackwardRecord:
        graph_task = torch._C._current_graph_task_id()
        if cls.current is None or cls.current.graph_task != graph_task:
            cls.current = _BackwardRecord(graph_task, delivery)
            torch.autograd.Variable._execution_engine.queue_callback(cls.current.forget)
        return cls.current


def _watch(reach: OutputReach, inputs: list[Any], outputs: Sequence[Any], delivery: GradientDelivery) -> None:
    watched = [
        (index, output) for index, output in enumerate(outputs)
        if index in reach.outputs and isinstance(output, torch.Tensor) and output.requires_grad
    ]
    if not watched:
        return

    def hook(grads: Sequence[torch.Tensor | None]) -> None:
        used = {index for (index, _), grad in zip(watched, grads) if grad is not None}
        record = _Backwards.record(delivery)
        for tensor, (_, reached) in zip(inputs, reach.inputs):
            if not isinstance(tensor, torch.Tensor):
                continue
            holder = delivery.holder_of(tensor)
            if reached & used:
                record.reached.add(id(holder))
            elif id(holder) not in record.unreached:
                record.unreached[id(holder)] = (holder, holder.grad is None)

    register_multi_grad_hook([output for _, output in watched], hook, mode="all")


def forget_unreached_gradients(
    compiled: Callable[..., Any], reach: OutputReach | None, delivery: GradientDelivery,
) -> Callable[..., Any]:
    """``compiled`` (a backend's compiled forward) that gives an unreached parameter back its None
    gradient; see [Note: a graph output left out of the loss]. ``compiled`` itself where the graph
    reads no managed parameter."""
    if reach is None:
        return compiled

    def run(*args: Any) -> Any:
        # AOTAutograd's compiled forward takes the inputs one by one, or boxed in one list.
        flat = args[0] if len(args) == 1 and isinstance(args[0], list) else args
        # Taken before the call: a boxed graph empties its argument list.
        inputs = [flat[index] for index, _ in reach.inputs] if torch.is_grad_enabled() else None
        outputs = compiled(*args)
        if inputs is not None and not torch._dynamo.config.compiled_autograd:
            _watch(reach, inputs, outputs if isinstance(outputs, (tuple, list)) else (outputs,), delivery)
        return outputs

    run.__dict__.update(compiled.__dict__)  # zero_grad, named_parameters, serialize, ...
    return run
