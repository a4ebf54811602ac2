"""The eager FSDP runtime: parameters, groups, collectives and the hooks of one ``fully_shard`` call.

It knows nothing of torch.compile: the compile layer (``fsdp_compile.compile``) builds on it, and
``fsdp_compile.module`` wires the two together (docs/design.md section 2).
"""
