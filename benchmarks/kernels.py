"""Benchmark the four copy-in / copy-out operations: Triton, the plain-torch reference, and FSDP2's own ops.

    python -m benchmarks.kernels                       # CUDA: 1 MB .. 1 GB groups, 1/10/100 parameters
    python -m benchmarks.kernels --sizes-mb 64 --params 100 --iters 50

Each row times one call for a whole parameter group. A group of S MB holds S MB of unsharded
parameters in ``--param-dtype``, split into N parameters of uneven dim 0, sharded over
``--world`` ranks (the [world, total] buffers are allocated in full on this one device; no
collective runs). The implementations compared:

* ``triton``: ``fsdp_compile.kernels.triton_impl`` (CUDA only), one launch per call.
* ``reference``: ``fsdp_compile.kernels.reference``, a copy kernel or two per parameter.
* ``fsdp2``: what FSDP2 runs in ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``:
  ``torch.ops.fsdp.all_gather_copy_in`` on padded shards, preceded under mixed precision by
  its ``torch._foreach_copy_`` cast into a flat buffer (two passes); ``torch.ops.fsdp.
  split_with_sizes_copy`` into padded unsharded outputs; ``torch.ops.fsdp.chunk_cat`` after a
  ``.to(reduce_dtype)`` when the dtypes differ, then ``div_``; and for the copy-out ``div_``,
  ``.to(orig_dtype)`` and either views into the result or ``grad += view``.

GB/s counts the bytes the operation must move at least (read each input element once, write
each output element once, whatever an implementation actually moves), so the columns compare;
"% copy" is that over the bandwidth of one large same-device ``copy_`` timed in the same run.
CUDA timings use CUDA events around ``--iters`` back-to-back calls. Without CUDA the script
says so and times the reference against FSDP2's ops on small CPU groups, so it still runs.
"""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import Callable

import torch

from fsdp_compile.kernels import reference
from fsdp_compile.layout import ShardLayout

try:
    # Importing the module defines torch.ops.fsdp.* (all_gather_copy_in, split_with_sizes_copy, chunk_cat).
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401

    HAVE_FSDP2_OPS = hasattr(torch.ops.fsdp, "chunk_cat")
except Exception:  # torch built without distributed
    HAVE_FSDP2_OPS = False

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OPS = ("all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in", "reduce_scatter_copy_out")
MB = 2**20
COPY_BYTES_CUDA = 1024 * MB
COPY_BYTES_CPU = 64 * MB


@dataclass(frozen=True)
class Group:
    """One parameter group: unsharded shapes split over ``world`` ranks as the runtime splits them."""

    shapes: list[tuple[int, ...]]
    world: int

    def layout(self, shape: tuple[int, ...], rank: int = 0) -> ShardLayout:
        return ShardLayout(shape, 0, self.world, rank)

    @property
    def padded(self) -> list[int]:
        return [self.layout(shape).padded_shard_numel for shape in self.shapes]

    @property
    def total(self) -> int:
        return sum(self.padded)

    def shard_rows(self, shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
        return self.layout(shape, rank).shard_shape()


def make_group(size_bytes: int, num_params: int, world: int, element_size: int, seed: int = 0) -> Group:
    """Split size_bytes into num_params (rows, cols) parameters with uneven row counts."""
    rng = random.Random(seed)
    numel = size_bytes // element_size
    cols = 1024 if numel >= 1024 * num_params * world else 1
    weights = [rng.uniform(0.5, 1.5) for _ in range(num_params)]
    shapes = []
    for weight in weights:
        rows = max(1, int(numel / cols * weight / sum(weights)))
        shapes.append((rows + (1 if rows % world == 0 else 0), cols))  # uneven: the last rank is short
    return Group(shapes, world)


@dataclass
class Case:
    """The tensors of one (op, group) and, per implementation, a zero-argument call."""

    bytes_moved: int
    calls: dict[str, Callable[[], None]]


def all_gather_copy_in_case(group: Group, src: torch.dtype, dst: torch.dtype, device, triton_impl) -> Case:
    rank = 0  # the first ranks hold full shards; the last may hold nothing
    shards = [torch.randn(group.shard_rows(s, rank), device=device).to(src) for s in group.shapes]
    output = torch.empty(group.world * group.total, dtype=dst, device=device)
    row = output.view(group.world, group.total)[rank]
    calls = {"reference": lambda: reference.all_gather_copy_in(shards, group.padded, row)}
    if triton_impl is not None:
        calls["triton"] = lambda: triton_impl.all_gather_copy_in(shards, group.padded, row)
    if HAVE_FSDP2_OPS:
        # FSDP2 keeps its sharded parameters padded, so its copy-in needs no zero-fill.
        padded_shards = [torch.zeros(p, dtype=src, device=device) for p in group.padded]

        def fsdp2() -> None:
            inputs = padded_shards
            if src != dst:  # _get_param_all_gather_inputs: foreach-copy cast into a flat buffer first
                flat = torch.empty(group.total, dtype=dst, device=device)
                inputs = list(torch.split(flat, group.padded))
                torch._foreach_copy_(inputs, padded_shards)
            torch.ops.fsdp.all_gather_copy_in(inputs, output, group.padded, group.total, rank)

        calls["fsdp2"] = fsdp2
    moved = sum(s.numel() for s in shards) * src.itemsize + group.total * dst.itemsize
    return Case(moved, calls)


def all_gather_copy_out_case(group: Group, src: torch.dtype, dst: torch.dtype, device, triton_impl) -> Case:
    gathered = torch.randn(group.world, group.total, device=device).to(src)
    outs = [torch.empty(s, dtype=dst, device=device) for s in group.shapes]
    calls = {"reference": lambda: reference.all_gather_copy_out(gathered, group.padded, outs)}
    if triton_impl is not None:
        calls["triton"] = lambda: triton_impl.all_gather_copy_out(gathered, group.padded, outs)
    if HAVE_FSDP2_OPS and src == dst:  # FSDP2 never casts in its copy-out
        # Its unsharded parameters are views into padded [world * padded] buffers.
        padded_outs = [torch.empty(group.world, p, dtype=dst, device=device) for p in group.padded]
        calls["fsdp2"] = lambda: torch.ops.fsdp.split_with_sizes_copy(gathered, group.padded, dim=1, out=padded_outs)
    moved = sum(o.numel() for o in outs) * (src.itemsize + dst.itemsize)
    return Case(moved, calls)


def reduce_scatter_copy_in_case(
    group: Group, src: torch.dtype, dst: torch.dtype, device, triton_impl, divide: float
) -> Case:
    grads = [torch.randn(s, device=device).to(src) for s in group.shapes]
    out = torch.empty(group.world, group.total, dtype=dst, device=device)
    calls = {"reference": lambda: reference.reduce_scatter_copy_in(grads, group.padded, out, divide)}
    if triton_impl is not None:
        calls["triton"] = lambda: triton_impl.reduce_scatter_copy_in(grads, group.padded, out, divide)
    if HAVE_FSDP2_OPS:

        def fsdp2() -> None:
            # foreach_reduce: cast the gradients to reduce_dtype, chunk_cat, then _div_if_needed.
            inputs = [g.to(dst) for g in grads] if src != dst else grads
            torch.ops.fsdp.chunk_cat(inputs, dim=0, num_chunks=group.world, out=out)
            if divide != 1.0:
                out.div_(divide)

        calls["fsdp2"] = fsdp2
    moved = sum(g.numel() for g in grads) * src.itemsize + out.numel() * dst.itemsize
    return Case(moved, calls)


def reduce_scatter_copy_out_case(
    group: Group, src: torch.dtype, dst: torch.dtype, device, triton_impl, divide: float, accumulate: bool
) -> Case:
    rank = 0  # the first ranks hold full shards; the last may hold nothing
    reduced = torch.randn(group.total, device=device).to(src)
    outs = [torch.zeros(group.shard_rows(s, rank), dtype=dst, device=device) for s in group.shapes]
    calls = {
        "reference": lambda: reference.reduce_scatter_copy_out(reduced, group.padded, outs, divide, accumulate)
    }
    if triton_impl is not None:
        calls["triton"] = lambda: triton_impl.reduce_scatter_copy_out(reduced, group.padded, outs, divide, accumulate)

    def fsdp2() -> None:
        # foreach_reduce's tail: divide, cast to the parameter dtype, then view or accumulate.
        value = reduced.div(divide) if divide != 1.0 else reduced
        value = value.to(dst)
        offset = 0
        for out, padded in zip(outs, group.padded):
            view = torch.as_strided(value, out.shape, out.stride(), offset)
            if accumulate:
                out += view
            offset += padded

    calls["fsdp2"] = fsdp2
    numel = sum(o.numel() for o in outs)
    moved = numel * (src.itemsize + dst.itemsize * (2 if accumulate else 1))
    return Case(moved, calls)


def time_call(call: Callable[[], None], device: torch.device, warmup: int, iters: int) -> float:
    """Seconds per call."""
    for _ in range(warmup):
        call()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    begin = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - begin) / iters


def copy_bandwidth(device: torch.device, nbytes: int, warmup: int, iters: int) -> float:
    """Bytes per second of one large same-device copy (read + write)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device, warmup, iters)
    del src, dst
    return 2 * nbytes / seconds


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels",
        description="Time the fsdp_compile copy-in/copy-out ops (Triton, reference) against FSDP2's torch.ops.fsdp ops; "
        "print a Markdown table of time, GB/s and the fraction of the device's measured copy bandwidth.",
    )
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), help="operations to time (default: all four)")
    parser.add_argument(
        "--sizes-mb", nargs="+", type=float, default=None,
        help="group sizes in MB of unsharded parameters in --param-dtype (default: 1 16 256 1024 on CUDA, 1 4 on CPU)",
    )
    parser.add_argument("--params", nargs="+", type=int, default=[1, 10, 100], help="parameters per group (default: 1 10 100)")
    parser.add_argument("--world", type=int, default=8, help="simulated world size (default: 8)")
    parser.add_argument("--param-dtype", choices=DTYPES, default="fp32", help="sharded parameters and their gradients (default: fp32)")
    parser.add_argument("--compute-dtype", choices=DTYPES, default="bf16", help="all-gathered parameters and unsharded gradients (default: bf16)")
    parser.add_argument("--reduce-dtype", choices=DTYPES, default="bf16", help="reduce-scatter buffers (default: bf16)")
    parser.add_argument("--divide", type=float, default=1.0, help="pre/post divide factor for the reduce-scatter ops (default: 1.0, as with ReduceOp.AVG)")
    parser.add_argument("--accumulate", action="store_true", help="reduce_scatter_copy_out adds into existing gradients")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per row (default: 20 on CUDA, 3 on CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls first, which also compile Triton (default: 3 on CUDA, 1 on CPU)")
    parser.add_argument("--cpu", action="store_true", help="run the CPU table even when CUDA is available")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if use_cuda else "cpu")
    sizes = args.sizes_mb or ([1, 16, 256, 1024] if use_cuda else [1, 4])
    iters = args.iters or (20 if use_cuda else 3)
    warmup = args.warmup if args.warmup is not None else (3 if use_cuda else 1)
    triton_impl = None
    if use_cuda:
        try:
            from fsdp_compile.kernels import triton_impl
        except ImportError:
            print("Triton is not installed: timing the reference and FSDP2's ops only.\n")
    else:
        print(
            "CUDA is not available: the Triton kernels need a GPU, so this times the plain-torch reference "
            "against FSDP2's torch.ops.fsdp ops on small CPU groups (the numbers say nothing about a GPU).\n"
        )
    if not HAVE_FSDP2_OPS:
        print("torch.ops.fsdp is unavailable in this torch build: no fsdp2 rows.\n")

    copy_bytes = COPY_BYTES_CUDA if use_cuda else COPY_BYTES_CPU
    peak = copy_bandwidth(device, copy_bytes, warmup, iters)
    name = torch.cuda.get_device_name(device) if use_cuda else "CPU"
    print(f"Device: {name}; same-device copy of {copy_bytes // MB} MB: {peak / 1e9:.1f} GB/s (read + write)")
    param, compute, reduce = (DTYPES[args.param_dtype], DTYPES[args.compute_dtype], DTYPES[args.reduce_dtype])
    print(
        f"world {args.world}; dtypes param {args.param_dtype}, compute {args.compute_dtype}, reduce "
        f"{args.reduce_dtype}; divide {args.divide}; accumulate {args.accumulate}; {iters} timed calls per row\n"
    )
    print("| op | cast | group MB | params | impl | time (us) | GB/s | % copy |")
    print("|---|---|---:|---:|---|---:|---:|---:|")
    for op in args.ops:
        src, dst = {
            "all_gather_copy_in": (param, compute),
            "all_gather_copy_out": (compute, compute),
            "reduce_scatter_copy_in": (compute, reduce),
            "reduce_scatter_copy_out": (reduce, param),
        }[op]
        cast = f"{_short(src)}->{_short(dst)}"
        for size_mb in sizes:
            for num_params in args.params:
                group = make_group(int(size_mb * MB), num_params, args.world, param.itemsize)
                if op == "all_gather_copy_in":
                    case = all_gather_copy_in_case(group, src, dst, device, triton_impl)
                elif op == "all_gather_copy_out":
                    case = all_gather_copy_out_case(group, src, dst, device, triton_impl)
                elif op == "reduce_scatter_copy_in":
                    case = reduce_scatter_copy_in_case(group, src, dst, device, triton_impl, args.divide)
                else:
                    case = reduce_scatter_copy_out_case(
                        group, src, dst, device, triton_impl, args.divide, args.accumulate
                    )
                for impl in ("triton", "reference", "fsdp2"):
                    if impl not in case.calls:
                        continue
                    seconds = time_call(case.calls[impl], device, warmup, iters)
                    rate = case.bytes_moved / seconds
                    print(
                        f"| {op} | {cast} | {size_mb:g} | {num_params} | {impl} | {seconds * 1e6:.1f} "
                        f"| {rate / 1e9:.1f} | {100 * rate / peak:.0f}% |"
                    )
                del case
                if use_cuda:
                    torch.cuda.empty_cache()


def _short(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


if __name__ == "__main__":
    main()
