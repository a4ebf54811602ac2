"""Runtime switches of fsdp_compile, in one place.

Set them as module attributes before the code they affect runs::

    import fsdp_compile
    fsdp_compile.config.skip_fsdp_hooks = True
"""
from __future__ import annotations

__all__ = ["skip_fsdp_hooks"]

# Under torch.compile, run the FSDP hooks eagerly between compiled regions (graph breaks)
# instead of tracing collectives into the graph. Numerics equal the eager runtime.
skip_fsdp_hooks: bool = False
