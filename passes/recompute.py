"""Joint-graph pass: groups with ``reshard_after_forward=True`` re-all-gather in backward.

Expects the AOTAutograd joint graph of a model traced through ``fsdp_compile.traceable``:
its unshard nodes carry ``node.meta["custom"]["fsdp"]``. Leaves those nodes (and the pure
views of their output) tagged ``MUST_RECOMPUTE`` when they belong to the forward and their
group reshards after forward, so the partitioner saves the small sharded input instead of the
full parameter and replays the all-gather in backward::

    before:  shard -> all_gather -> wait -> narrow -> mm        (full param saved for backward)
    after:   shard -> [all_gather -> wait -> narrow]^recompute -> mm   (shard saved)
"""
from __future__ import annotations

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from fsdp_compile.passes.graph import RESHARD_AFTER_FORWARD_KEY, fsdp_annotation, is_tangent, is_view

__all__ = ["tag_reshard_after_forward_for_recompute"]

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


def tag_reshard_after_forward_for_recompute(graph: fx.Graph) -> int:
    """Tag forward unshard chains of resharding groups ``MUST_RECOMPUTE``; returns how many nodes."""
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
