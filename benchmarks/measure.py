"""How one step of one mode is measured: its time, and in a separate probe step its memory, saved tensors and collectives.

Timed steps carry no instrumentation. The probe step runs once per mode after the timed steps,
so the profiler, the saved-tensor hooks and the memory sampler never touch a timing.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from benchmarks.modes import Mode
from fsdp_compile.models import next_token_loss

__all__ = ["train_step", "timed_step", "probe_step", "Probe", "count_collectives", "CollectiveCounts", "quiet_profiler"]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(mode: Mode, tokens: torch.Tensor) -> torch.Tensor:
    """Forward, backward, optimizer step; returns this rank's loss (detached)."""
    with mode.step_context():
        loss = next_token_loss(mode.model(tokens), tokens)
        loss.backward()
        start = time.perf_counter()
        mode.optimizer.step()
        mode.optimizer.zero_grad(set_to_none=True)
        mode.optimizer_s = time.perf_counter() - start
    return loss.detach()


def timed_step(mode: Mode, tokens: torch.Tensor, device: torch.device) -> tuple[float, torch.Tensor]:
    _synchronize(device)
    start = time.perf_counter()
    loss = train_step(mode, tokens)
    _synchronize(device)
    return time.perf_counter() - start, loss


# ---- memory -------------------------------------------------------------------------------

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except OSError:
        return None


def _return_free_memory_to_os() -> None:
    # [Note: RSS baseline] glibc keeps freed blocks in its arenas, so without a trim the memory
    # another mode's step freed would sit in RSS and this step would reuse it unseen.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _RssSampler:
    """Peak RSS of this process while the context is open, read every ``interval_s`` by a thread."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes() or 0)
            time.sleep(self.interval_s)

    def __enter__(self) -> "_RssSampler":
        self.peak = _rss_bytes() or 0
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes() or 0)


@contextlib.contextmanager
def _peak_memory(device: torch.device) -> Iterator[dict]:
    """Yields a dict filled on exit with ``peak`` (bytes) and ``before`` (bytes just before)."""
    result: dict = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        result["before"] = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result["peak"] = torch.cuda.max_memory_allocated(device)
        return
    _return_free_memory_to_os()
    result["before"] = _rss_bytes()
    with _RssSampler() as sampler:
        yield result
    result["peak"] = sampler.peak if result["before"] is not None else None


# ---- saved tensors ------------------------------------------------------------------------

@contextlib.contextmanager
def _saved_bytes() -> Iterator[dict]:
    """Sum the bytes of distinct tensors autograd saves for backward (dedup by address and size)."""
    seen: dict = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        try:
            key = (tensor.data_ptr(), nbytes)
        except RuntimeError:  # tensors without storage (e.g. subclasses): count each once
            key = (id(tensor), nbytes)
        seen[key] = nbytes
        return tensor

    result: dict = {}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield result
    result["bytes"] = sum(seen.values())
    result["tensors"] = len(seen)


# ---- collectives --------------------------------------------------------------------------

@contextlib.contextmanager
def _quiet_stderr_fd() -> Iterator[None]:
    # Kineto prints a line to fd 2 on every profiler start and stop; it would shred the progress bar.
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def quiet_profiler(record_shapes: bool = False, cuda: bool = False) -> Iterator[torch.profiler.profile]:
    """torch.profiler over the CPU ops (and with ``cuda`` the device's kernels and copies) run while
    open, without Kineto's start and stop lines on stderr."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    profiler = torch.profiler.profile(activities=activities, record_shapes=record_shapes)
    with _quiet_stderr_fd():
        profiler.__enter__()
    try:
        yield profiler
    finally:
        with _quiet_stderr_fd():
            profiler.__exit__(None, None, None)


def _collective_kind(op_name: str) -> str:
    name = op_name.removeprefix("c10d::")
    if "allgather" in name or "all_gather" in name:
        return "all_gather"
    if "reduce_scatter" in name:
        return "reduce_scatter"
    if "allreduce" in name or "all_reduce" in name:
        return "all_reduce"
    if "alltoall" in name or "all_to_all" in name:
        return "all_to_all"
    return name.rstrip("_")


class CollectiveCounts(collections.Counter):
    """Collectives by kind, and ``nbytes``: the bytes this rank handed to them (each collective's input)."""

    nbytes: int = 0


# The profiler's names of element types -> bytes per element.
_ITEMSIZE = {
    "float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "signed char": 1, "unsigned char": 1,
    "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "int": 4, "long int": 8, "long": 8,
}
# Where each collective's input tensor sits among the profiled op's inputs. The c10d ops of the eager
# runtimes carry shapes (an all-to-all's too, traced or not); traced graphs' coalesced c10d ops carry
# tensor lists without them, so those are read from the functional op that issued them.
_INPUT_INDEX = {
    "c10d::_allgather_base_": 1, "c10d::_reduce_scatter_base_": 1, "c10d::alltoall_base_": 1,
    "_c10d_functional::all_gather_into_tensor": 0, "_c10d_functional::reduce_scatter_tensor": 0,
    "_c10d_functional::all_reduce": 0, "_c10d_functional::all_reduce_": 0,
}


def _input_bytes(index: int, shapes: list[list[int]], dtypes: list[str]) -> int:
    if len(shapes) <= index or not shapes[index]:
        return 0
    return math.prod(shapes[index]) * _ITEMSIZE.get(dtypes[index], 0)


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """Count the c10d ops dispatched while open, by kind, and the bytes handed to them (``.nbytes``).

    [Note: counting collectives] Every collective reaches the process group as one ``c10d::`` op,
    whoever issues it: FSDP2's and our eager hooks (``_allgather_base_``, ``_reduce_scatter_base_``)
    and functional collectives traced into a compiled graph (``allgather_into_tensor_coalesced_``).
    The profiler sees them all, so the count is the same kind of fact in every mode.
    """
    counts = CollectiveCounts()
    with quiet_profiler(record_shapes=True) as profiler:
        yield counts
    # The raw events, not profiler.events(): that builds the Python event tree of every op recorded,
    # seconds when a first compile (thousands of fake-tensor ops) ran inside the window.
    for event in profiler.profiler.kineto_results.events():
        name = event.name()
        if name.startswith("c10d::"):
            counts[_collective_kind(name)] += 1
        index = _INPUT_INDEX.get(name)
        if index is not None:
            counts.nbytes += _input_bytes(index, event.shapes(), event.dtypes())


# ---- the probe step -----------------------------------------------------------------------

@dataclass(frozen=True)
class Probe:
    peak_bytes: int | None
    step_bytes: int | None  # peak minus the value just before the step
    saved_bytes: int | None
    saved_tensors: int | None
    collectives: dict[str, int]
    recorded_collectives: int | None  # fsdp_compile.record_collectives() for ours modes, as a cross-check
    wire_bytes: int  # bytes this rank handed to collectives in the step (their inputs; see count_collectives)


def probe_step(mode: Mode, tokens: torch.Tensor, device: torch.device) -> Probe:
    """One instrumented, untimed training step."""
    import fsdp_compile

    record = fsdp_compile.record_collectives() if mode.ours else contextlib.nullcontext(None)
    with count_collectives() as counts, record as log, _peak_memory(device) as memory:
        with mode.step_context():
            with _saved_bytes() as saved:
                loss = next_token_loss(mode.model(tokens), tokens)
            loss.backward()
            mode.optimizer.step()
            mode.optimizer.zero_grad(set_to_none=True)
    peak, before = memory.get("peak"), memory.get("before")
    return Probe(
        peak_bytes=peak,
        step_bytes=None if peak is None or before is None else max(0, peak - before),
        saved_bytes=saved["bytes"],
        saved_tensors=saved["tensors"],
        collectives=dict(counts),
        recorded_collectives=None if log is None else len(log),
        wire_bytes=counts.nbytes,
    )
