"""Fused copy-in / copy-out for the grouped collectives (docs/design.md section 4).

Four ``torch.library`` custom ops, one call per parameter group each: see ``reference.py``
for the layout and the exact arithmetic. On CUDA they run as Triton kernels when Triton is
installed; everywhere else (and as the definition) in plain torch.

Three more for the low-precision collectives (``quantized.py``): the int8 / float8_e4m3fn
all-gather's quantizing copy-in and dequantizing copy-out, and the float32 row sum after a
bf16 all-to-all; ``quantize_blocks`` / ``dequantize_blocks`` / ``sum_rows`` are their pure
versions for compiled graphs (``quantized_reference.py``).
"""
from fsdp_compile.kernels.ops import (
    all_gather_copy_in,
    all_gather_copy_in_functional,
    all_gather_copy_out,
    all_gather_copy_out_functional,
    reduce_scatter_copy_in,
    reduce_scatter_copy_out,
)
from fsdp_compile.kernels.quantized import (
    quantized_all_gather_copy_in,
    quantized_all_gather_copy_out,
    sum_rows_copy_out,
)
from fsdp_compile.kernels.quantized_reference import (
    DEFAULT_BLOCK_SIZE,
    E4M3_BYTES,
    QMAX,
    WIRE_DTYPES,
    dequantize_blocks,
    quantize_blocks,
    quantized_slot_numels,
    sum_rows,
)

__all__ = [
    "all_gather_copy_in",
    "all_gather_copy_in_functional",
    "all_gather_copy_out",
    "all_gather_copy_out_functional",
    "reduce_scatter_copy_in",
    "reduce_scatter_copy_out",
    "quantized_all_gather_copy_in",
    "quantized_all_gather_copy_out",
    "sum_rows_copy_out",
    "DEFAULT_BLOCK_SIZE",
    "E4M3_BYTES",
    "QMAX",
    "WIRE_DTYPES",
    "dequantize_blocks",
    "quantize_blocks",
    "quantized_slot_numels",
    "sum_rows",
]


def _register_triton_kernels() -> None:
    """Make the Triton kernels the ops' CUDA implementation; without Triton the reference serves CUDA too."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return
    from fsdp_compile.kernels import quantized_triton, triton_impl

    triton_impl.register_cuda_kernels()
    quantized_triton.register_cuda_kernels()


_register_triton_kernels()
