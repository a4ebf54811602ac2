"""Post-grad pass: prefetch all-gathers and sink waits under an in-flight budget. Not written yet.

Until it is, ``PassConfig.reorder`` must stay ``False``: each bucketed collective is waited on
right after it is issued (no overlap), and asking for reordering fails loudly instead of
silently doing nothing.
"""
from __future__ import annotations

import torch.fx as fx

from fsdp_compile.config import PassConfig

__all__ = ["reorder_collectives"]


def reorder_collectives(gm: fx.GraphModule, config: PassConfig) -> fx.GraphModule:
    if config.reorder:
        raise NotImplementedError(
            "fsdp_compile: the reorder pass (prefetch / late waits) is not implemented yet; "
            "leave fsdp_compile.config.passes.reorder=False"
        )
    return gm
