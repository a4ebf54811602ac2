"""Joint-graph pass: groups with ``reshard_after_forward=True`` re-all-gather in backward.

Expects the AOTAutograd joint graph of a model traced through ``fsdp_compile.compile.param_reads``:
its unshard nodes carry ``node.meta["custom"]["fsdp"]``. Leaves those nodes (and the pure
views of their output) tagged ``MUST_RECOMPUTE`` when they belong to the forward and their
group reshards after forward, so the partitioner saves the small sharded input instead of the
full parameter and replays the all-gather in backward::

    before:  shard -> all_gather -> wait -> narrow -> mm        (full param saved for backward)
    after:   shard -> [all_gather -> wait -> narrow]^recompute -> mm   (shard saved)

A block compiled as a nested region (see [Note: compile once per block] in regions.py) takes its
unsharded parameters as inputs; the region's own partition saves them by returning them from its
forward. Those pass-through outputs are first replaced by the region's inputs, so the outer
partition sees the unshard chain feed the region's backward and replays it there too.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from fsdp_compile.passes.graph import (
    ALL_GATHER, BLOCK_FRAME_TOKEN, COPY_IN, DELIVER_GRADIENT, DELIVER_REDUCE_SCATTER_LATE, FRAME_GATHER, KEEPS_GATHERED_KEY,
    REDUCE_SCATTER, RESHARD_AFTER_FORWARD_KEY, STATE_KEY,
    erase_unused_chain, fsdp_annotation, give_up, host_source, is_cast, is_tangent, is_view, new_node, node_value,
    single_wait,
)

__all__ = [
    "tag_reshard_after_forward_for_recompute", "read_region_saved_inputs_directly", "gather_frames_through_prefetch", "deliver_frame_reductions_late",
]

# One id for every tagged region: consecutive tagged nodes never force a save between them.
_AC_GRAPH_ID = 1_000_000


def _backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that depend on a tangent (the incoming gradient): the backward part of the joint graph."""
    backward: set[fx.Node] = set()
    for node in graph.nodes:
        if is_tangent(node):
            backward.add(node)
        elif any(isinstance(arg, fx.Node) and arg in backward for arg in node.all_input_nodes):
            backward.add(node)
    return backward


def _is_forward_region_call(node: fx.Node) -> bool:
    return (
        node.op == "call_function" and node.target is torch.ops.higher_order.invoke_subgraph
        and isinstance(node.args[1], str) and "fw" in node.args[1]
    )


def _view_chain_of_input(value: Any) -> list[fx.Node] | None:
    """``[placeholder, view, view, ...]`` when ``value`` is an input of its graph or views of it."""
    chain: list[fx.Node] = []
    while isinstance(value, fx.Node) and value.op != "placeholder":
        if not is_view(value) or any(isinstance(a, fx.Node) for a in (*value.args[1:], *value.kwargs.values())):
            return None
        chain.append(value)
        value = value.args[0]
    return [value, *reversed(chain)] if isinstance(value, fx.Node) else None


def read_region_saved_inputs_directly(graph: fx.Graph) -> int:
    """Where a partitioned region's forward returns one of its inputs (or a view of it) for its
    backward, let the backward read that input (a view of it taken outside) instead; returns how
    many saved values were rerouted."""
    owner = graph.owning_module
    rerouted = 0
    for call in list(graph.nodes):
        if not _is_forward_region_call(call) or owner is None:
            continue
        body = getattr(owner, call.args[0].target, None)
        if not isinstance(body, fx.GraphModule):
            continue
        # The body's inputs by the call's operands. A view's other arguments (a symbolic size, with
        # dynamic shapes) are the region's inputs too and map the same way; one computed inside
        # the body has no value outside, so that output stays saved as the region returns it.
        operand = {placeholder: call.args[2 + index] for index, placeholder in enumerate(body.graph.find_nodes(op="placeholder"))}
        returned = body.graph.find_nodes(op="output")[0].args[0]
        for user in list(call.users):
            if user.target is not operator.getitem:
                continue
            chain = _view_chain_of_input(returned[user.args[1]])
            if chain is None:
                continue
            if any(arg not in operand for view, inner in zip(chain[1:], chain) for arg in view.all_input_nodes if arg is not inner):
                # Only an unsharded parameter (an annotated unshard's output) left saved costs
                # memory: an activation view (``x.view(-1, dim)`` for a weight's gradient) is saved
                # for backward either way.
                if fsdp_annotation(operand[chain[0]]) is not None:
                    give_up(
                        "recompute", "region %s returns a view of its parameter input %s sized inside its body; it stays "
                        "saved for backward", call.args[1], chain[0].name,
                    )
                continue
            outside = operand[chain[0]]
            with graph.inserting_before(call):
                for view, inner in zip(chain[1:], chain):
                    outside = graph.node_copy(view, lambda arg, inner=inner, previous=outside: previous if arg is inner else operand[arg])
            user.replace_all_uses_with(outside)
            rerouted += 1
    return rerouted


def gather_frames_through_prefetch(graph: fx.Graph, backward: bool) -> int:
    """See [Note: prefetch across block frames] in fsdp_compile/compile/frames.py and [Note: backward prefetch across block frames] in
    compile/frames.py: in a block frame's forward or backward graph (post-grad, bucketed and
    reordered), the group's copy-in and all-gather become one ``fsdp_compile::frame_all_gather`` call
    on the same shards (a CPU-offloaded shard's host tensor, not its copy on the device), in the same
    place; the wait stays where the reorder pass put it::

        before:  shards -> copy_in -> all_gather -> ... wait -> copy_out
        after:   shards -> frame_all_gather -> ... wait -> copy_out

    Only a block frame's all-gather (``STATE_KEY`` is ``BLOCK_FRAME_TOKEN``), or one group's that the
    runtime keeps gathered across a backward (``KEEPS_GATHERED_KEY``: [Note: keeping parameters
    gathered across a backward] in kept_gathers.py), whose input is the copy-in of its shards, or a lone
    parameter's flattened shard with at most a cast and rows of padding (``bucket.unpadded_shard``).
    Returns how many were rewritten."""
    from fsdp_compile.passes.bucket import unpadded_shard

    rewritten = 0
    for gather in list(graph.find_nodes(op="call_function", target=ALL_GATHER)):
        annotation = fsdp_annotation(gather)
        if annotation is None or (annotation.get(STATE_KEY) != BLOCK_FRAME_TOKEN and not annotation.get(KEEPS_GATHERED_KEY)):
            continue
        sent, shard_size, group_name = gather.args
        if sent.target is COPY_IN:
            shards, padded_numels, dtype = sent.args
            copies = shards  # erased below once unused; a lone shard's copy goes with the chain of ``sent``
        elif sent.target in (torch.ops.aten.reshape.default, torch.ops.aten.view.default) and list(sent.args[1]) == [-1]:
            value = node_value(sent)
            shard = unpadded_shard(sent.args[0], value.numel())
            if shard is None:
                continue
            shards, padded_numels, dtype, copies = [shard], [value.numel()], value.dtype, []
        else:
            continue
        # A CPU-offloaded shard's copy to the device is the runtime's: [Note: offloaded shards under whole-model compile].
        shards = [host_source(shard) or shard for shard in shards]
        with graph.inserting_before(gather):
            arguments = (shards, padded_numels, dtype, shard_size, group_name, backward, node_value(sent).device)
            issued = new_node(graph, FRAME_GATHER, arguments, annotation)
        gather.replace_all_uses_with(issued)
        graph.erase_node(gather)
        erase_unused_chain(graph, sent)  # the copy-in (or the pad and cast) the call does now
        for copy in copies:
            erase_unused_chain(graph, copy)
        rewritten += 1
    return rewritten


# What may lie between a block frame's reduce-scatter wait and a parameter's delivered gradient: its
# columns of the bucket (a dim-0 slice), its shape, the gradient's divide and cast (``is_cast``), all of which the
# runtime's copy-out does again ([Note: late reduce-scatter wait across block frames] in frames.py).
_DELIVERY_STEPS = (
    torch.ops.aten.slice.Tensor, torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
    torch.ops.aten.div.Tensor,
)


def _delivery_chain(wait: fx.Node) -> tuple[list[tuple[int, int, fx.Node]], list[fx.Node], bool]:
    """What reads ``wait``'s result through one-input nodes: ``(offset, numel, deliver node)`` for each
    parameter delivered, in offset order; every node met, in the order met; and whether they are
    plain delivery steps that cover the result whole (the rewrite's condition)."""
    total = node_value(wait).numel()
    members, met, frontier, plain = [], [], [(wait, 0, total)], True
    while frontier:
        node, offset, numel = frontier.pop()
        for user in node.users:
            if user in met:
                plain = False  # two paths meet: not a plain chain
                continue
            met.append(user)
            if user.target is DELIVER_GRADIENT and user.args[0] is node:
                members.append((offset, numel, user))
                continue
            if len(user.all_input_nodes) != 1:
                plain = False
                continue
            if user.target is torch.ops.aten.slice.Tensor and node is wait and user.args[1] == 0 and len(user.args) <= 4:
                start, end = user.args[2], min(user.args[3], total)
                frontier.append((user, start, end - start))
                continue
            plain = plain and (user.target in _DELIVERY_STEPS or is_cast(user)) and user.target is not torch.ops.aten.slice.Tensor
            frontier.append((user, offset, numel))
    members.sort(key=lambda member: member[0])
    covered = 0
    for offset, numel, _ in members:
        plain = plain and offset == covered
        covered += numel
    return members, met, plain and covered == total


def deliver_frame_reductions_late(graph: fx.Graph) -> int:
    """See [Note: late reduce-scatter wait across block frames] in compile/frames.py: in a block
    frame's backward graph (post-grad, bucketed and reordered), a bucket's reduce-scatter whose
    result only goes to its parameters' deliveries leaves the graph in flight, handed to the runtime
    at the graph's end; the wait, the copy-out and the deliveries go::

        before:  grads -> reduce_scatter -> wait -> slice/view/div/cast -> deliver_reduced_gradient(g_i, sink_i)
        after:   grads -> reduce_scatter -> ... -> deliver_reduce_scatter_late(in flight, its input, [sink_i])

    Returns how many were rewritten."""
    output = next(iter(graph.find_nodes(op="output")))
    rewritten = 0
    for reduce_scatter in list(graph.find_nodes(op="call_function", target=REDUCE_SCATTER)):
        annotation = fsdp_annotation(reduce_scatter)
        wait = single_wait(reduce_scatter)
        if annotation is None or annotation.get(STATE_KEY) != BLOCK_FRAME_TOKEN or wait is None:
            continue
        members, chain, plain = _delivery_chain(wait)
        if not members:
            continue  # not a delivering group's (HSDP, the gradient wire, tensor parallelism)
        if not plain:
            give_up("deliver_late", "the reduce-scatter %s is read other than by its parameters' deliveries; waited in the graph", reduce_scatter.name)
            continue
        sinks = [deliver.args[1] for _, _, deliver in members]
        with graph.inserting_before(output):
            handed = new_node(graph, DELIVER_REDUCE_SCATTER_LATE, (reduce_scatter, reduce_scatter.args[0], sinks), annotation)
        for _, _, deliver in members:
            deliver.replace_all_uses_with(handed)
        # What reads the deliveries' (zero) sink gradients, the bucket pass's sum of a tied
        # parameter's reads' sink gradients, moves after the hand-over, in order.
        late_readers = {handed}
        for node in list(graph.nodes):
            if node.op != "output" and node is not handed and any(arg in late_readers for arg in node.all_input_nodes):
                late_readers.add(node)
                output.prepend(node)
        for node in reversed(chain):  # met after what it reads: readers go first
            graph.erase_node(node)
        graph.erase_node(wait)
        rewritten += 1
    return rewritten


def tag_reshard_after_forward_for_recompute(graph: fx.Graph) -> int:
    """Tag forward unshard chains of resharding groups ``MUST_RECOMPUTE``; returns how many nodes."""
    read_region_saved_inputs_directly(graph)
    backward = _backward_nodes(graph)
    tagged: list[fx.Node] = []
    for node in graph.nodes:
        if node.op != "call_function" or node in backward:
            continue
        annotation = fsdp_annotation(node)
        if annotation is not None and annotation.get(RESHARD_AFTER_FORWARD_KEY):
            tagged.append(node)
    frontier = list(tagged)
    seen = set(tagged)
    while frontier:  # views of the full parameter would otherwise be saved in its place
        node = frontier.pop()
        for user in node.users:
            if user not in seen and user not in backward and is_view(user):
                seen.add(user)
                tagged.append(user)
                frontier.append(user)
    for node in tagged:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta["ac_graph_id"] = _AC_GRAPH_ID
    return len(tagged)
