"""Benchmark the four copy-in / copy-out operations: Triton, the plain-torch reference, and FSDP2's own ops.

    python -m benchmarks.kernels                       # CUDA: 1 MB .. 1 GB groups, 1/10/100 parameters
    python -m benchmarks.kernels --sizes-mb 64 --params 100 --iters 50
    python -m benchmarks.kernels --dtypes fp32/fp32/fp32 fp32/bf16/fp32 --impls triton inductor --jsonl rows.jsonl

Each row times one call for a whole parameter group. A group of S MB holds S MB of unsharded
parameters in ``--param-dtype``, split into N parameters of uneven dim 0, sharded over
``--world`` ranks (the [world, total] buffers are allocated in full on this one device; no
collective runs). The implementations compared:

* ``triton``: ``fsdp_compile.kernels.triton_impl`` (CUDA only), one launch per call.
* ``reference``: ``fsdp_compile.kernels.reference``, a copy kernel or two per parameter.
* ``inductor``: the reference compiled by ``torch.compile(..., backend=--compile-backend,
  dynamic=False, fullgraph=True)``: the fused code Inductor writes for it, one compile per group
  shape (static shapes: under ``dynamic=True`` Dynamo cannot trace the reference's ``divmod`` of
  sizes and would run it eagerly). Compiling happens in the warm-up calls, outside the timing.
  ``--inductor-params`` and ``--inductor-sizes-mb`` limit it to some groups, as each shape costs a compile.
* ``fsdp2``: what FSDP2 runs in ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``:
  ``torch.ops.fsdp.all_gather_copy_in`` on padded shards, preceded under mixed precision by
  its ``torch._foreach_copy_`` cast into a flat buffer (two passes); ``torch.ops.fsdp.
  split_with_sizes_copy`` into padded unsharded outputs; ``torch.ops.fsdp.chunk_cat`` after a
  ``.to(reduce_dtype)`` when the dtypes differ, then ``div_``; and for the copy-out ``div_``,
  ``.to(orig_dtype)`` and either views into the result or ``grad += view``.

GB/s counts the bytes the operation must move at least (read each input element once, write
each output element once, whatever an implementation actually moves), so the columns compare;
"% copy" is that over the bandwidth of one large same-device ``copy_`` timed in the same run.
CUDA timings: the device time of ``--iters`` back-to-back calls between CUDA events, queued behind
a sleep on the stream so the host's launching stays out of it, and apart from it the host's time
per call (see [Note: device time apart from host time]); GB/s is from the device time. Without CUDA the script
says so and times the reference against FSDP2's ops (and the compiled reference) on small CPU
groups, so it still runs.

``--dtypes`` takes several PARAM/COMPUTE/REDUCE triples (e.g. ``fp32/fp32/fp32`` for no cast at
all and ``fp32/bf16/fp32`` for torchtitan's mixed precision); each operation runs with the source
and destination dtypes each triple gives it, once per distinct pair. ``--jsonl`` appends every row
(and first the device's copy bandwidth) to a file as JSON lines as they are measured, so a run
cut short keeps what it measured (``python -m benchmarks.gpu`` reads it).
"""
from __future__ import annotations

import argparse
import functools
import json
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from fsdp_compile.kernels import reference
from fsdp_compile.runtime.layout import ShardLayout

try:
    # Importing the module defines torch.ops.fsdp.* (all_gather_copy_in, split_with_sizes_copy, chunk_cat).
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401

    HAVE_FSDP2_OPS = hasattr(torch.ops.fsdp, "chunk_cat")
except Exception:  # torch built without distributed
    HAVE_FSDP2_OPS = False

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OPS = ("all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in", "reduce_scatter_copy_out")
# Table order within a row group; "inductor" is the reference compiled (see the module docstring).
IMPLS = ("triton", "reference", "inductor", "fsdp2")
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

    @functools.cached_property
    def padded(self) -> list[int]:
        # Cached: the calls timed take it as an argument, and its layouts would be the host's time.
        return [self.layout(shape).padded_shard_numel for shape in self.shapes]

    @functools.cached_property
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


# An implementation with the reference's signature: ``fsdp_compile.kernels.reference``, ``triton_impl``
# or ``CompiledReference``; keyed by its table name.
Impls = dict[str, Any]


def all_gather_copy_in_case(group: Group, src: torch.dtype, dst: torch.dtype, device, impls: Impls, fsdp2: bool = HAVE_FSDP2_OPS) -> Case:
    rank = 0  # the first ranks hold full shards; the last may hold nothing
    shards = [torch.randn(group.shard_rows(s, rank), device=device).to(src) for s in group.shapes]
    output = torch.empty(group.world * group.total, dtype=dst, device=device)
    row = output.view(group.world, group.total)[rank]
    calls = {name: (lambda impl=impl: impl.all_gather_copy_in(shards, group.padded, row)) for name, impl in impls.items()}
    if fsdp2:
        # FSDP2 keeps its sharded parameters padded, so its copy-in needs no zero-fill.
        padded_shards = [torch.zeros(p, dtype=src, device=device) for p in group.padded]

        def fsdp2_call() -> None:
            inputs = padded_shards
            if src != dst:  # _get_param_all_gather_inputs: foreach-copy cast into a flat buffer first
                flat = torch.empty(group.total, dtype=dst, device=device)
                inputs = list(torch.split(flat, group.padded))
                torch._foreach_copy_(inputs, padded_shards)
            torch.ops.fsdp.all_gather_copy_in(inputs, output, group.padded, group.total, rank)

        calls["fsdp2"] = fsdp2_call
    moved = sum(s.numel() for s in shards) * src.itemsize + group.total * dst.itemsize
    return Case(moved, calls)


def all_gather_copy_out_case(group: Group, src: torch.dtype, dst: torch.dtype, device, impls: Impls, fsdp2: bool = HAVE_FSDP2_OPS) -> Case:
    gathered = torch.randn(group.world, group.total, device=device).to(src)
    outs = [torch.empty(s, dtype=dst, device=device) for s in group.shapes]
    calls = {name: (lambda impl=impl: impl.all_gather_copy_out(gathered, group.padded, outs)) for name, impl in impls.items()}
    if fsdp2 and src == dst:  # FSDP2 never casts in its copy-out
        # Its unsharded parameters are views into padded [world * padded] buffers.
        padded_outs = [torch.empty(group.world, p, dtype=dst, device=device) for p in group.padded]
        calls["fsdp2"] = lambda: torch.ops.fsdp.split_with_sizes_copy(gathered, group.padded, dim=1, out=padded_outs)
    moved = sum(o.numel() for o in outs) * (src.itemsize + dst.itemsize)
    return Case(moved, calls)


def reduce_scatter_copy_in_case(
    group: Group, src: torch.dtype, dst: torch.dtype, device, impls: Impls, divide: float, fsdp2: bool = HAVE_FSDP2_OPS
) -> Case:
    grads = [torch.randn(s, device=device).to(src) for s in group.shapes]
    out = torch.empty(group.world, group.total, dtype=dst, device=device)
    calls = {
        name: (lambda impl=impl: impl.reduce_scatter_copy_in(grads, group.padded, out, divide)) for name, impl in impls.items()
    }
    if fsdp2:

        def fsdp2_call() -> None:
            # foreach_reduce: cast the gradients to reduce_dtype, chunk_cat, then _div_if_needed.
            inputs = [g.to(dst) for g in grads] if src != dst else grads
            torch.ops.fsdp.chunk_cat(inputs, dim=0, num_chunks=group.world, out=out)
            if divide != 1.0:
                out.div_(divide)

        calls["fsdp2"] = fsdp2_call
    moved = sum(g.numel() for g in grads) * src.itemsize + out.numel() * dst.itemsize
    return Case(moved, calls)


def reduce_scatter_copy_out_case(
    group: Group, src: torch.dtype, dst: torch.dtype, device, impls: Impls, divide: float, accumulate: bool,
    fsdp2: bool = True,
) -> Case:
    rank = 0  # the first ranks hold full shards; the last may hold nothing
    reduced = torch.randn(group.total, device=device).to(src)
    outs = [torch.zeros(group.shard_rows(s, rank), dtype=dst, device=device) for s in group.shapes]
    calls = {
        name: (lambda impl=impl: impl.reduce_scatter_copy_out(reduced, group.padded, outs, divide, accumulate))
        for name, impl in impls.items()
    }

    def fsdp2_call() -> None:
        # foreach_reduce's tail: divide, cast to the parameter dtype, then view or accumulate.
        value = reduced.div(divide) if divide != 1.0 else reduced
        value = value.to(dst)
        offset = 0
        for out, padded in zip(outs, group.padded):
            view = torch.as_strided(value, out.shape, out.stride(), offset)
            if accumulate:
                out += view
            offset += padded

    if fsdp2:  # plain torch ops: no torch.ops.fsdp needed
        calls["fsdp2"] = fsdp2_call
    numel = sum(o.numel() for o in outs)
    moved = numel * (src.itemsize + dst.itemsize * (2 if accumulate else 1))
    return Case(moved, calls)


class CompiledReference:
    """The four reference functions, each compiled once by ``torch.compile`` (static shapes, one graph).

    Dynamo keeps one cache entry per group shape and dtype on each function's code object, so the
    recompile limits are lifted (a table has dozens of shapes), and a limit hit fails instead of
    quietly timing the eager reference under this name.
    """

    def __init__(self, backend: str) -> None:
        import torch._dynamo

        # Names as of torch 2.6 or so; set only where this torch has them.
        for name, value in (("recompile_limit", 1_000_000), ("accumulated_recompile_limit", 1_000_000),
                            ("fail_on_recompile_limit_hit", True)):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, value)
        for name in OPS:
            setattr(self, name, torch.compile(getattr(reference, name), backend=backend, dynamic=False, fullgraph=True))


@dataclass(frozen=True)
class Timing:
    """Seconds per call: on the device (kernels back to back) and on the host (launching them)."""

    device_s: float
    host_s: float


def time_call(call: Callable[[], None], device: torch.device, warmup: int, iters: int) -> Timing:
    """Per-call device and host time; on CPU both are the wall time.

    [Note: device time apart from host time] Events around a loop of calls measure the larger of
    the host's launch time and the kernels' time: a small group's copy takes microseconds on the
    device but its Python and launch cost more, so the first H200 table showed ~1.5 ms per call at
    every size, the host's. Here the host's time per call is measured alone first (no synchronize
    inside the loop), then the stream is held by ``torch.cuda._sleep`` for longer than the host
    needs to queue all calls, so the events around them see only the kernels, back to back.
    """
    for _ in range(warmup):
        call()
    if device.type != "cuda":
        begin = time.perf_counter()
        for _ in range(iters):
            call()
        seconds = (time.perf_counter() - begin) / iters
        return Timing(seconds, seconds)
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(iters):
        call()
    host_s = (time.perf_counter() - begin) / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(_sleep_cycles_per_s(device) * (2.0 * host_s * iters + 1e-3)))
    start.record()
    for _ in range(iters):
        call()
    end.record()
    end.synchronize()
    return Timing(start.elapsed_time(end) / 1e3 / iters, host_s)


_SLEEP_CALIBRATION: dict[torch.device, float] = {}


def _sleep_cycles_per_s(device: torch.device) -> float:
    """How many ``torch.cuda._sleep`` cycles one second of device time holds (measured once)."""
    if device not in _SLEEP_CALIBRATION:
        cycles = 10_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)  # warm-up
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _SLEEP_CALIBRATION[device] = cycles / (start.elapsed_time(end) / 1e3)
    return _SLEEP_CALIBRATION[device]


def copy_bandwidth(device: torch.device, nbytes: int, warmup: int, iters: int) -> float:
    """Bytes per second of one large same-device copy (read + write)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device, warmup, iters).device_s
    del src, dst
    return 2 * nbytes / seconds


def _dtype_triple(text: str) -> tuple[str, str, str]:
    parts = tuple(text.split("/"))
    if len(parts) != 3 or any(part not in DTYPES for part in parts):
        raise argparse.ArgumentTypeError(f"expected PARAM/COMPUTE/REDUCE of {', '.join(DTYPES)} (e.g. fp32/bf16/fp32), got {text!r}")
    return parts  # type: ignore[return-value]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels",
        description="Time the fsdp_compile copy-in/copy-out ops (Triton, reference, the reference compiled by Inductor) "
        "against FSDP2's torch.ops.fsdp ops; print a Markdown table of time, GB/s and the fraction of the device's "
        "measured copy bandwidth.",
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
    parser.add_argument(
        "--dtypes", nargs="+", type=_dtype_triple, default=None, metavar="PARAM/COMPUTE/REDUCE",
        help="several dtype settings in one table, e.g. fp32/fp32/fp32 fp32/bf16/fp32 (default: the three flags above); "
        "each op runs once per distinct (source, destination) pair they give it",
    )
    parser.add_argument("--divide", type=float, default=1.0, help="pre/post divide factor for the reduce-scatter ops (default: 1.0, as with ReduceOp.AVG)")
    parser.add_argument("--accumulate", action="store_true", help="reduce_scatter_copy_out adds into existing gradients")
    parser.add_argument(
        "--impls", nargs="+", choices=IMPLS, default=None,
        help=f"implementations to time (default: {' '.join(IMPLS)}; on CPU without inductor, whose C++ compile per shape is slow there)",
    )
    parser.add_argument(
        "--inductor-params", nargs="+", type=int, default=None,
        help="time the compiled reference only at these parameter counts (default: every --params); each group shape is one compile",
    )
    parser.add_argument(
        "--inductor-sizes-mb", nargs="+", type=float, default=None,
        help="time the compiled reference only at these group sizes (default: every --sizes-mb)",
    )
    parser.add_argument(
        "--compile-backend", default="inductor",
        help="torch.compile backend of the 'inductor' rows (default inductor; aot_eager traces the same graphs without code generation)",
    )
    parser.add_argument("--iters", type=int, default=None, help="timed calls per row (default: 20 on CUDA, 3 on CPU)")
    parser.add_argument(
        "--warmup", type=int, default=None,
        help="untimed calls first, which also compile Triton and Inductor code (default: 3 on CUDA, 1 on CPU)",
    )
    parser.add_argument("--host-profile", action="store_true",
                        help="after the uncompiled rows, cProfile each op's first implementation on a small group")
    parser.add_argument("--cpu", action="store_true", help="run the CPU table even when CUDA is available")
    parser.add_argument("--jsonl", default=None, metavar="PATH", help="also append each row to PATH as a JSON line, as it is measured")
    return parser.parse_args(argv)


# The (source, destination) dtypes of each op under a (param, compute, reduce) setting.
def op_dtypes(op: str, param: str, compute: str, reduce: str) -> tuple[str, str]:
    return {
        "all_gather_copy_in": (param, compute),
        "all_gather_copy_out": (compute, compute),
        "reduce_scatter_copy_in": (compute, reduce),
        "reduce_scatter_copy_out": (reduce, param),
    }[op]


def _build_case(op: str, group: Group, src: torch.dtype, dst: torch.dtype, device, impls: Impls, fsdp2: bool, args) -> Case:
    if op == "all_gather_copy_in":
        return all_gather_copy_in_case(group, src, dst, device, impls, fsdp2 and HAVE_FSDP2_OPS)
    if op == "all_gather_copy_out":
        return all_gather_copy_out_case(group, src, dst, device, impls, fsdp2 and HAVE_FSDP2_OPS)
    if op == "reduce_scatter_copy_in":
        return reduce_scatter_copy_in_case(group, src, dst, device, impls, args.divide, fsdp2 and HAVE_FSDP2_OPS)
    return reduce_scatter_copy_out_case(group, src, dst, device, impls, args.divide, args.accumulate, fsdp2)


class _RowLog:
    """Appends JSON lines to ``--jsonl`` (if given), flushed per row so a killed run keeps its rows."""

    def __init__(self, path: str | None) -> None:
        self.file = open(path, "a") if path else None

    def write(self, **row: Any) -> None:
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()


def main(argv=None) -> None:
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if use_cuda else "cpu")
    sizes = args.sizes_mb or ([1, 16, 256, 1024] if use_cuda else [1, 4])
    iters = args.iters or (20 if use_cuda else 3)
    warmup = args.warmup if args.warmup is not None else (3 if use_cuda else 1)
    wanted = args.impls or [impl for impl in IMPLS if use_cuda or impl != "inductor"]
    impls: Impls = {}
    if "triton" in wanted and use_cuda:
        try:
            from fsdp_compile.kernels import triton_impl

            impls["triton"] = triton_impl
        except ImportError:
            print("Triton is not installed: no triton rows.\n")
    elif "triton" in wanted:
        print(
            "CUDA is not available: the Triton kernels need a GPU, so this times the plain-torch reference "
            "against FSDP2's torch.ops.fsdp ops (and the compiled reference) on small CPU groups (the numbers say "
            "nothing about a GPU).\n"
        )
    if "reference" in wanted:
        impls["reference"] = reference
    compiled = CompiledReference(args.compile_backend) if "inductor" in wanted else None
    inductor_label = "inductor" if args.compile_backend == "inductor" else f"compiled ({args.compile_backend})"
    want_fsdp2 = "fsdp2" in wanted
    if want_fsdp2 and not HAVE_FSDP2_OPS:
        print("torch.ops.fsdp is unavailable in this torch build: fsdp2 rows only for reduce_scatter_copy_out.\n")

    copy_bytes = COPY_BYTES_CUDA if use_cuda else COPY_BYTES_CPU
    peak = copy_bandwidth(device, copy_bytes, warmup, iters)
    name = torch.cuda.get_device_name(device) if use_cuda else "CPU"
    log = _RowLog(args.jsonl)
    log.write(kind="device", device=name, copy_bytes=copy_bytes, copy_gb_s=peak / 1e9, iters=iters, warmup=warmup,
              world=args.world, divide=args.divide, accumulate=args.accumulate, torch=torch.__version__)
    print(f"Device: {name}; same-device copy of {copy_bytes // MB} MB: {peak / 1e9:.1f} GB/s (read + write)")
    settings = args.dtypes or [(args.param_dtype, args.compute_dtype, args.reduce_dtype)]
    # Each op once per distinct (src, dst) pair, in --ops order, then in --dtypes order; the group
    # is sized in the param dtype of the setting that first gave the pair.
    pairs: dict[tuple[str, str, str], str] = {}
    for op in args.ops:
        for setting in settings:
            pairs.setdefault((op, *op_dtypes(op, *setting)), setting[0])
    print(
        f"world {args.world}; dtypes (param/compute/reduce) {', '.join('/'.join(s) for s in settings)}; divide "
        f"{args.divide}; accumulate {args.accumulate}; {iters} timed calls per row\n"
    )
    print("| op | cast | group MB | params | impl | device us | host us | GB/s | % copy |")
    print("|---|---|---:|---:|---|---:|---:|---:|---:|", flush=True)
    # Two passes: the uncompiled implementations, then the compiled reference, whose compile per
    # group shape costs seconds; within each, parameter counts outermost. A run cut short thus keeps
    # whole tables of the first counts given, for every implementation but the compiled one.
    passes = [(impls, want_fsdp2, args.params, sizes)]
    if compiled is not None:
        passes.append(({inductor_label: compiled}, False, args.inductor_params or args.params, args.inductor_sizes_mb or sizes))
    for index, (pass_impls, fsdp2, param_counts, pass_sizes) in enumerate(passes):
        if index == 1 and args.host_profile:
            _print_host_profile(impls, pairs, args, device)
        for num_params in param_counts:
            for (op, src_name, dst_name), param_name in pairs.items():
                for size_mb in pass_sizes:
                    group = make_group(int(size_mb * MB), num_params, args.world, DTYPES[param_name].itemsize)
                    case = _build_case(op, group, DTYPES[src_name], DTYPES[dst_name], device, pass_impls, fsdp2, args)
                    row = dict(kind="row", op=op, cast=f"{src_name}->{dst_name}", size_mb=size_mb, params=num_params)
                    for impl in [*IMPLS[:2], inductor_label, "fsdp2"]:
                        if impl in case.calls:
                            _time_row(case, impl, row, device, warmup, iters, peak, log)
                    del case
                    if use_cuda:
                        torch.cuda.empty_cache()


def _print_host_profile(impls: Impls, pairs: dict, args: argparse.Namespace, device: torch.device) -> None:
    """Where the host's time per call goes: cProfile over calls of each op on a small group (10
    parameters, 1 MB), for the first implementation timed (Triton on CUDA), top functions by own time."""
    import cProfile
    import io
    import pstats

    if not impls:
        return
    name = next(iter(impls))
    calls = 200
    print(f"\nHost profile: {name}, {calls} calls per op on a 10-parameter 1 MB group, functions by own time (tottime)\n")
    for (op, src_name, dst_name), param_name in pairs.items():
        group = make_group(MB, 10, args.world, DTYPES[param_name].itemsize)
        case = _build_case(op, group, DTYPES[src_name], DTYPES[dst_name], device, {name: impls[name]}, False, args)
        call = case.calls[name]
        for _ in range(3):
            call()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            call()
        profiler.disable()
        if device.type == "cuda":
            torch.cuda.synchronize()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(10)
        total_us = stats.total_tt / calls * 1e6
        body = "\n".join(line for line in text.getvalue().splitlines() if line.strip() and not line.startswith("   Ordered"))
        print(f"{op} {src_name}->{dst_name}: {total_us:.0f} us per call under the profiler\n```\n{body}\n```", flush=True)


def _time_row(case: Case, impl: str, row: dict, device: torch.device, warmup: int, iters: int, peak: float, log: _RowLog) -> None:
    """Time one implementation of ``case``; print its table row and log it (an error too, as its row)."""
    row = dict(row, impl=impl, bytes=case.bytes_moved)
    cells = f"| {row['op']} | {row['cast']} | {row['size_mb']:g} | {row['params']} | {impl} |"
    try:
        timing = time_call(case.calls[impl], device, warmup, iters)
    except Exception as error:  # noqa: BLE001 - one failing implementation leaves the others' rows
        message = f"{type(error).__name__}: {next(iter(str(error).splitlines()), '')}"[:200]
        log.write(**row, error=message)
        print(f"{cells} error: {message.replace('|', '/')} | | | |", flush=True)
        return
    rate = case.bytes_moved / timing.device_s
    log.write(**row, us=timing.device_s * 1e6, host_us=timing.host_s * 1e6, gb_s=rate / 1e9, copy_fraction=rate / peak)
    print(f"{cells} {timing.device_s * 1e6:.1f} | {timing.host_s * 1e6:.1f} | {rate / 1e9:.1f} | {100 * rate / peak:.0f}% |",
          flush=True)

if __name__ == "__main__":
    main()
