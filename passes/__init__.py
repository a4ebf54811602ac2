"""FX graph passes of the fsdp_inductor backend, importable as ``fsdp_compile.passes``.

Each pass is a pure function ``(GraphModule, PassConfig) -> GraphModule`` (docs/design.md section 5.3):

- ``recompute.py`` (joint graph): resharding groups re-all-gather in backward.
- ``bucket.py`` (post-grad): one all-gather / reduce-scatter per ``fully_shard`` group.
- ``reorder.py`` (post-grad): prefetch all-gathers, wait late, under an in-flight byte budget; then
  a block frame's all-gathers (forward and backward) take the prefetch across frames, and its reduce-scatters
  leave the graph in flight, waited in the next block's backward (``recompute.py``).
- ``dump.py``: ``FSDP_COMPILE_DUMP=dir`` writes graphs and timelines around each pass.
- ``graph.py``: what they share: collective ops, the FSDP annotation, graph kind, views, bytes in
  flight, and the counter of passes that gave up.
"""
from __future__ import annotations

import torch.fx as fx

__all__ = ["apply_post_grad_passes"]


def apply_post_grad_passes(gm: fx.GraphModule, config) -> fx.GraphModule:
    """Run bucket then reorder on a partitioned forward or backward graph, dumping around each.

    Example::

        gm = apply_post_grad_passes(backward_graph_module, fsdp_compile.config.passes)
    """
    from fsdp_compile.passes.bucket import bucket_collectives
    from fsdp_compile.passes.dump import dump_graph
    from fsdp_compile.passes.graph import graph_kind, one_wait_per_collective
    from fsdp_compile.passes.recompute import deliver_frame_reductions_late, gather_frames_through_prefetch
    from fsdp_compile.passes.reorder import reorder_collectives

    config = config.resolved()
    kind = graph_kind(gm)
    dump_graph(gm, kind, "0-input", config)
    # [Note: one wait per collective] in graph.py: once per graph, here, not in each pass below.
    if one_wait_per_collective(gm.graph):
        gm.graph.lint()
        gm.recompile()
    gm = bucket_collectives(gm, config)
    dump_graph(gm, kind, "1-after-bucket", config)
    gm = reorder_collectives(gm, config)
    dump_graph(gm, kind, "2-after-reorder", config)
    # [Note: prefetch across block frames] in fsdp_compile/compile/frames.py (and its backward's) in fsdp_compile/module.py: where the
    # reorder pass placed a block frame's all-gather, it takes the one the block before it issued.
    if gather_frames_through_prefetch(gm.graph, backward=kind == "backward"):
        gm.graph.lint()
        gm.recompile()
        dump_graph(gm, kind, "3-after-frame-prefetch", config)
    # [Note: late reduce-scatter wait across block frames] in compile/frames.py.
    if kind == "backward" and deliver_frame_reductions_late(gm.graph):
        gm.graph.lint()
        gm.recompile()
        dump_graph(gm, kind, "4-after-late-delivery", config)
    return gm
