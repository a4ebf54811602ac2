"""Parameters kept gathered across a backward (``set_reshard_after_backward(False)``) under a
whole-model compile with blocks as frames: what the runtime keeps of a group's all-gather for the next
forward, and what a graph gets of it (docs/design.md section 5.4). ``frames.py``'s ``BlockFrame`` holds
one ``KeptGather`` per group whose all-gathers are the runtime's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fsdp_compile.runtime.state import FSDPState

__all__ = ["KeptGather", "addresses_and_versions", "columns_for_graph"]

# [Note: keeping parameters gathered across a backward]
# set_reshard_after_backward(False) (gradient accumulation, 1F1B micro-batches) leaves a group's
# parameters gathered after its backward, so the next forward sends no all-gather for it; eagerly,
# post-backward does not reshard and the next pre-forward finds the group unsharded. A compiled
# graph's all-gather cannot be skipped by the graph: it is a node, and what it gathered is freed
# once the graph read it. A block frame's all-gather is the runtime's, though (frame_all_gather,
# [Note: prefetch across block frames] in frames.py), and so is a group's outside blocks once its reads are traced
# with KEEPS_GATHERED_KEY (the root's, registered as its pre-forward runs, rewritten by the same
# pass): there the runtime keeps what the group gathered, BlockFrame.kept, and the next forward's
# all-gather of the group takes it instead of sending one, as eagerly:
# - what is kept is the group's whole all-gather output in the forward's layout, waited on: the
#   backward's gather of a resharding group (a whole-group all-gather in place of the backward
#   graph's, which may gather only the parameters backward reads, cut to the graph's layout, so it
#   sends what eager's backward unshard sends), or, for a group that keeps its parameters after
#   forward (reshard_after_forward=False, the root), the forward's;
# - the graph gets a tensor of its own, never the kept one (a copy, or the cut), and the kept one
#   is handed out only once it is let go: Inductor may reuse a buffer once its graph read it;
# - a kept gather is taken only where the group's shards are those it was gathered from, at the
#   same versions (the optimizer's step, a load or a .data swap make it stale: let go, gathered
#   again); a frame Dynamo runs eagerly lets it go (its eager hooks gather). Here compiled and eager
#   differ on purpose: eagerly (and in FSDP2) a forward after an optimizer step that found the group
#   still gathered trains on the stale gathered values (seen: other losses than resharding); FSDP2's
#   recipe, set_reshard_after_backward(True) on the last micro-batch, never meets either;
# - FSDPModule.reshard() lets it go (CompiledFSDPState.let_go_of_kept_gather), as eagerly it frees
#   the unsharded parameters: the next forward gathers again;
# - set_reshard_after_backward is read where the runtime gathers: the backward's gather keeps with it
#   False; a forward's gather keeps where the group does not reshard after forward (held from there
#   through the backward, as eagerly) and the setting is False as the forward runs. With True (the
#   last micro-batch) nothing is kept, and what the last backward kept is still taken by the next
#   forward (eagerly the group is unsharded until then); after it, nothing is held.
# A block frame's graph never reads the setting (the runtime does): no recompile. A group outside
# blocks traces its all-gather through the runtime while the setting is False or a kept gather waits
# for it (BlockFrameFSDPState.keeps_gathered_across_frames): its graph guards on both, one more graph
# where that changes. Not kept (gathered again, numerics unchanged): a block whose gathers are not
# the runtime's (CommPolicy's quantized all-gather, tensor-parallel parameters: refused in policy.py,
# as are blocks not compiled as frames), a group with a rank holding no rows of a parameter
# (frames.py: _gathers_identifiably_in_frames). A kept gather holds the group's gathered bytes until the next
# forward takes it, where eager holds its unsharded parameters.


def addresses_and_versions(shards: list[torch.Tensor]) -> list[tuple[int, int]]:
    """What an all-gather was issued on: a later read of other or since-written shards differs."""
    return [(shard.data_ptr(), shard._version) for shard in shards]


class KeptGather:
    """The all-gather output of one group (``state``'s), waited on, kept across a backward for the
    next forward's gather, with what it was gathered from: the layout ``(indices, padded numels,
    dtype, shard size, process group)`` and the shards' addresses and versions."""

    def __init__(self, state: "FSDPState") -> None:
        self.state = state
        self._gathered: torch.Tensor | None = None
        self._gathered_from: tuple | None = None

    @property
    def holds(self) -> bool:
        return self._gathered is not None

    def keeps_from_forward(self) -> bool:
        """Whether the group's forward gather is kept: it stays gathered after forward and, with
        set_reshard_after_backward(False), after backward."""
        group = self.state.group
        return group is not None and not group.reshard_after_backward and not self.state.reshards_after_forward

    def whole_layout(self, forward_layout: tuple | None) -> tuple | None:
        """The layout a backward gather takes to be kept (the forward's, the whole group), or None
        where it is not kept."""
        group = self.state.group
        return None if group is None or group.reshard_after_backward else forward_layout

    def keep(self, in_flight: torch.Tensor, layout: tuple, shards: list[torch.Tensor]) -> torch.Tensor:
        """Wait on ``in_flight`` (``shards`` gathered in ``layout``) and keep it. Returns the kept
        tensor, which the caller copies or cuts for the graph: a graph may reuse its buffers."""
        gathered = torch.ops._c10d_functional.wait_tensor(in_flight)
        self._gathered, self._gathered_from = gathered, (layout, addresses_and_versions(shards))
        self.state.serves_kept_gather = True
        return gathered

    def take(self, layout: tuple, shards: list[torch.Tensor]) -> torch.Tensor | None:
        """For a forward's graph gathering ``shards`` in ``layout``: what was kept of exactly them (a
        copy where it stays kept), or None; a stale one is let go."""
        gathered = self._gathered
        if gathered is None:
            return None
        if self._gathered_from != (layout, addresses_and_versions(shards)):
            self.let_go()
            return None
        if self.keeps_from_forward():
            return gathered.clone()
        self.let_go()
        return gathered

    def let_go(self) -> None:
        self._gathered, self._gathered_from = None, None
        self.state.serves_kept_gather = False


def columns_for_graph(gathered: torch.Tensor, whole: tuple, layout: tuple) -> torch.Tensor:
    """A backward graph's all-gather output (its ``layout``: the parameters backward reads) cut from
    ``gathered``, the group's whole all-gather in ``whole``, as a tensor of its own."""
    indices, padded_numels, _, shard_size, _ = whole
    if layout[0] == indices:
        return gathered.clone()
    columns, offset = {}, 0
    for index, numel in zip(indices, padded_numels):
        columns[index] = (offset, numel)
        offset += numel
    rows = gathered.view(shard_size, offset)
    return torch.cat([rows[:, start:start + numel] for start, numel in (columns[index] for index in layout[0])], dim=1).reshape(-1)
