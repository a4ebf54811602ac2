"""Fused copy-in / copy-out for the grouped collectives (DESIGN.md section 4).

Four ``torch.library`` custom ops, one call per parameter group each: see ``reference.py``
for the layout and the exact arithmetic. On CUDA they run as Triton kernels when Triton is
installed; everywhere else (and as the definition) in plain torch.
"""
from fsdp_compile.kernels.ops import (
    all_gather_copy_in,
    all_gather_copy_out,
    reduce_scatter_copy_in,
    reduce_scatter_copy_out,
)

__all__ = [
    "all_gather_copy_in",
    "all_gather_copy_out",
    "reduce_scatter_copy_in",
    "reduce_scatter_copy_out",
]


def _register_triton_kernels() -> None:
    """Make the Triton kernels the ops' CUDA implementation; without Triton the reference serves CUDA too."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return
    from fsdp_compile.kernels import triton_impl

    triton_impl.register_cuda_kernels()


_register_triton_kernels()
