"""FX graph passes of the fsdp_inductor backend, importable as ``fsdp_compile.passes``.

Each pass is a pure function ``(GraphModule, PassConfig) -> GraphModule`` (DESIGN.md section 5).
"""
