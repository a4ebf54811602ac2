"""Post-grad pass: issue all-gathers ahead of their use and wait on collectives late, under a budget.

Runs after ``bucket.py`` on a partitioned forward or backward graph whose collectives are each
read through one wait ([Note: one wait per collective] in graph.py). The graph's other nodes keep
their order (the "compute stream"); the pass only decides where two kinds of movable blocks go:

- an all-gather's *issue block*: the all-gather and the copy-in nodes only it reads (pad, cast,
  reshape, ``cat`` of this rank's shards);
- a collective's *wait block*: its ``wait_tensor`` and the copy-out nodes of the same bucket that
  hang off it (view, slice, reshape, stride pin, the gradient divide: whatever is computed from
  its result alone); for an HSDP reduce-scatter also the replica all-reduce and its wait, which
  stay right behind the reduce-scatter's wait.

[Note: the reorder schedule]
With ``k = prefetch_depth`` and all-gathers numbered by group in graph order (forward: module order;
backward: the re-gathers of recomputed groups, last block first; a quantized gather's data and
scales are one group's two all-gathers and move together)::

    issue AG 0..k-1 right after the placeholders
    for each compute-stream node, in order:
        place the wait block of every collective it reads          (wait at first use)
        an AG whose wait must be placed but was never issued is issued right there (no overlap)
        after the wait block of AG j: issue AG j+1..j+k             (prefetch k groups ahead)
        a reduction (reduce-scatter, or CommPolicy's all-to-all wire) issues where bucket.py put it
        (after its group's last gradient); once more than k are in flight, the oldest is waited on
                                                                    (late waits)
    the output node reads every remaining result: the last waits sit right before it

so with ``k = 1`` group i+1's all-gather runs during group i's compute, and group i's
reduce-scatter during group i-1's backward. ``k = 0`` keeps each collective next to its use.

In flight means issued and not yet waited on; its bytes are ``collective_bytes`` (graph.py): the
all-gather's output (the unsharded bucket), the reduce-scatter's input (the unsharded gradients),
the HSDP all-reduce's reduced shard, the tensors that stay allocated until the wait.
``max_inflight_bytes`` bounds their sum at every point of the graph, as ``graph.inflight_bytes``
counts it (and the dump timeline prints it): a prefetch that does not fit is postponed (all-gathers
keep their order, so later ones wait too), and before a collective that must issue now, the
oldest collectives in flight are waited on until it fits. A single collective larger than the
budget issues alone, at its use. An HSDP all-reduce needs no room of its own: it issues in its
reduce-scatter's wait block, right after that wait released the unsharded gradients, and holds
a 1/world shard of them.

Every decision reads only the graph and the config (no timings, no rank), so every rank builds
the same schedule. ``fsdp_inductor`` also turns off Inductor's ``reorder_for_peak_memory`` while
this pass runs: that scheduler pass would otherwise move each all-gather back down to its use.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from fsdp_compile.config import PassConfig
from fsdp_compile.passes.graph import (
    ALL_GATHER, ALL_REDUCE, COLLECTIVES, GRADIENT_REDUCTIONS, GROUP_KEY, WAIT, collective_bytes,
    collective_nodes, fsdp_annotation, give_up, single_wait,
)

__all__ = ["reorder_collectives"]


@dataclass(eq=False)  # identity: entries are looked up in lists
class _Collective:
    node: fx.Node
    wait_block: list[fx.Node]
    issue_block: list[fx.Node] = field(default_factory=list)  # all-gathers only; else the stream issues it
    index: int = 0  # position among the all-gathers
    unit: int = 0  # its group's position among the all-gathered groups (a quantized gather's data and scales share one)
    nbytes: int = 0
    issued: bool = False
    waited: bool = False


def _wait_block(collective: fx.Node, position: dict[fx.Node, int]) -> list[fx.Node] | None:
    """The wait and what is computed from its result alone (copy-out views, the gradient divide,
    an HSDP all-reduce and its wait), in graph order."""
    wait = single_wait(collective)
    if wait is None:
        return None
    block = {wait}
    frontier = [wait]
    while frontier:
        for user in frontier.pop().users:
            if user in block or user.op != "call_function" or user.target in (ALL_GATHER, *GRADIENT_REDUCTIONS):
                continue
            if user.is_impure() and user.target not in (ALL_REDUCE, WAIT):
                continue
            if all(i in block for i in user.all_input_nodes):
                block.add(user)
                frontier.append(user)
    return sorted(block, key=position.__getitem__)


def _issue_block(all_gather: fx.Node, position: dict[fx.Node, int]) -> list[fx.Node]:
    """The all-gather and the pure nodes feeding it that nothing else reads, in graph order."""
    ancestors: set[fx.Node] = set()
    frontier = [all_gather]
    while frontier:
        for node in frontier.pop().all_input_nodes:
            if node not in ancestors and node.op == "call_function" and not node.is_impure() and node.target not in (*COLLECTIVES, WAIT):
                ancestors.add(node)
                frontier.append(node)
    block = {all_gather}
    for node in sorted(ancestors, key=position.__getitem__, reverse=True):  # users before producers
        if all(user in block for user in node.users):
            block.add(node)
    return sorted(block, key=position.__getitem__)


def _collectives(graph: fx.Graph) -> list[_Collective] | None:
    """The all-gathers and reductions to schedule, or None if one has an unexpected shape."""
    found: list[_Collective] = []
    gathers = 0
    units: dict[object, int] = {}
    position = {node: i for i, node in enumerate(graph.nodes)}
    candidates = [*collective_nodes(graph, ALL_GATHER), *(n for target in GRADIENT_REDUCTIONS for n in collective_nodes(graph, target))]
    for node in sorted(candidates, key=position.__getitem__):
        if fsdp_annotation(node) is None:
            continue  # not FSDP's (tensor parallelism's own): left where its code put it
        wait_block = _wait_block(node, position)
        if wait_block is None:
            return None
        entry = _Collective(node, wait_block, nbytes=collective_bytes(node))
        if node.target is ALL_GATHER:
            entry.issue_block = _issue_block(node, position)
            entry.index = gathers
            gathers += 1
            annotation = fsdp_annotation(node)
            unit_key = annotation.get(GROUP_KEY, node)
            entry.unit = units.setdefault(unit_key, len(units))
        found.append(entry)
    return found


def _input_only_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Pure nodes computed from the graph's inputs alone (e.g. the padded shards a copy-in reads,
    which the forward also saves for backward): a prefetch may pull them up with it."""
    free: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            free.add(node)
        elif (
            node.op == "call_function" and not node.is_impure() and node.target not in (*COLLECTIVES, WAIT)
            and all(i in free for i in node.all_input_nodes)
        ):
            free.add(node)
    return free


class _Scheduler:
    """Builds the new node order; see [Note: the reorder schedule]."""

    def __init__(self, graph: fx.Graph, collectives: list[_Collective], config: PassConfig) -> None:
        self.depth = max(0, config.prefetch_depth)
        self.budget = config.max_inflight_bytes
        self.all_gathers = [c for c in collectives if c.node.target is ALL_GATHER]
        self.block_of: dict[fx.Node, tuple[str, _Collective]] = {}
        for collective in collectives:
            for node in collective.issue_block:
                self.block_of[node] = ("issue", collective)
            for node in collective.wait_block:
                self.block_of[node] = ("wait", collective)
        self.by_node = {c.node: c for c in collectives}
        self.free = _input_only_nodes(graph)
        self.stream = [node for node in graph.nodes if node not in self.block_of]
        self.order: list[fx.Node] = []
        self.placed: set[fx.Node] = set()
        self.in_flight: list[_Collective] = []  # issue order
        self.last_waited_unit = -1

    def run(self) -> list[fx.Node]:
        for node in self.stream:
            if node.op == "placeholder":  # first and in order: their order is the graph's signature
                self._place(node)
        for node in self.stream:
            collective = self.by_node.get(node)
            if collective is not None:  # a reduce-scatter, issued where bucket.py put it
                self._make_room_for(collective)
            self._place(node)
            if collective is not None:
                collective.issued = True
                self.in_flight.append(collective)
                while sum(c.node.target in GRADIENT_REDUCTIONS for c in self.in_flight) > self.depth:
                    self._emit_wait(next(c for c in self.in_flight if c.node.target in GRADIENT_REDUCTIONS))
            self._prefetch()
        return self.order

    def _place(self, node: fx.Node) -> None:
        if node in self.placed:
            return
        for producer in node.all_input_nodes:
            if producer in self.placed:
                continue
            kind, collective = self.block_of.get(producer, ("stream", None))
            if kind == "wait":
                self._emit_wait(collective)
            elif kind == "issue":
                self._emit_issue(collective)
            else:
                self._place(producer)
        self.order.append(node)
        self.placed.add(node)

    def _inflight_bytes(self) -> int:
        return sum(c.nbytes for c in self.in_flight)

    def _fits(self, collective: _Collective) -> bool:
        return self.budget is None or self._inflight_bytes() + collective.nbytes <= self.budget

    def _make_room_for(self, collective: _Collective) -> None:
        while self.in_flight and not self._fits(collective):
            self._emit_wait(self.in_flight[0])

    def _emit_issue(self, collective: _Collective) -> None:
        if collective.issued:
            return
        # All-gathers issue in order: an earlier one postponed by the budget goes first.
        for earlier in self.all_gathers[: collective.index]:
            if not earlier.issued:
                self._emit_issue(earlier)
        self._make_room_for(collective)
        for node in collective.issue_block:
            self._place(node)
        collective.issued = True
        self.in_flight.append(collective)

    def _emit_wait(self, collective: _Collective) -> None:
        if collective.waited:
            return
        if collective.node.target is ALL_GATHER:
            self._emit_issue(collective)
        collective.waited = True  # before placing: the block's own nodes must not re-enter here
        if collective in self.in_flight:
            self.in_flight.remove(collective)
        for node in collective.wait_block:
            self._place(node)
        if collective.node.target is ALL_GATHER:
            self.last_waited_unit = max(self.last_waited_unit, collective.unit)
            self._prefetch()

    def _prefetch(self) -> None:
        for collective in self.all_gathers:
            if collective.unit > self.last_waited_unit + self.depth:
                return
            if collective.issued:
                continue
            ready = all(
                producer in self.placed or producer in self.free or self.block_of.get(producer, (None, None))[1] is collective
                for node in collective.issue_block for producer in node.all_input_nodes
            )
            if not ready or not self._fits(collective):
                return  # keep the all-gathers in order: the later ones wait for this one
            self._emit_issue(collective)


def reorder_collectives(gm: fx.GraphModule, config: PassConfig) -> fx.GraphModule:
    """Prefetch all-gathers and wait late, as in [Note: the reorder schedule].

    Example::

        gm = reorder_collectives(bucket_collectives(gm, config), PassConfig(prefetch_depth=1))
    """
    if not config.reorder:
        return gm
    graph = gm.graph
    collectives = _collectives(graph)
    if collectives is None:
        give_up("reorder", "a collective's result is read other than through one wait; graph left in order")
        return gm
    if not collectives:
        return gm
    order = _Scheduler(graph, collectives, config).run()
    if len(order) != len(graph.nodes) or set(order) != set(graph.nodes):
        raise AssertionError("fsdp reorder: the schedule lost or duplicated nodes")
    previous = order[0]
    for node in order[1:]:
        previous.append(node)  # moves ``node`` right behind ``previous``
        previous = node
    graph.lint()
    gm.recompile()
    return gm
