"""Everything that exists because of torch.compile: trace-context predicates, the custom ops graphs
hold, traced parameter reads, blocks as frames and as regions, the compile policy, the backends.

It imports the runtime (``fsdp_compile.runtime``), never the other way (docs/design.md section 2).
"""
