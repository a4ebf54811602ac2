"""``fsdp_compile.backend``, the import path the docs and users name for the backends; they live in
``fsdp_compile.compile.backend``."""
from fsdp_compile.compile.backend import fsdp_aot_eager, fsdp_inductor, fsdp_inductor_with, observe_graphs

__all__ = ["fsdp_inductor", "fsdp_inductor_with", "fsdp_aot_eager", "observe_graphs"]
