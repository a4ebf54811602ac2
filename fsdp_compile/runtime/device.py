"""Streams and events behind one interface, so CPU+gloo and CUDA+NCCL share all runtime logic.

[Note: overlap without streams]
Collectives are always issued with ``async_op=True`` and waited on at first use. On CPU the gloo
backend runs them on its own thread, which overlaps them with compute; there are no streams, so
every stream operation here is a no-op (``None`` streams and events). On CUDA the copy-ins and
collectives run on side streams ordered by events (see [Note: stream protocol] in
comm_context.py), and NCCL's ``work.wait()`` makes the current stream (not the CPU) wait, so the
CPU runs ahead and issues the next all-gather while the GPU computes.

Every call names the work it orders (``phase``, ``purpose``): on CUDA the phase shows up in profiler
traces, and a recording handle (the tests' stand-in) can check the protocol on CPU.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

__all__ = ["DeviceHandle", "make_device_handle"]


class DeviceHandle:
    """The few stream and event operations the runtime uses; no-ops on a device without streams."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.uses_streams = device.type == "cuda"

    def new_stream(self, name: str) -> Any:
        """A side stream for one purpose ("all_gather", "reduce_scatter", ...); ``None`` without streams."""
        if not self.uses_streams:
            return None
        # Higher priority so communication copies are not starved by compute kernels.
        return torch.cuda.Stream(device=self.device, priority=-1)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.uses_streams else None

    @contextlib.contextmanager
    def on_stream(self, stream: Any, phase: str) -> Iterator[None]:
        """Run the block on ``stream`` (the current stream when ``None``), named ``phase`` in traces."""
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream), torch.profiler.record_function(f"fsdp::{phase}"):
            yield

    def wait_stream(self, waiter: Any, waited: Any) -> None:
        """``waiter`` runs nothing more until all work queued on ``waited`` so far is done."""
        if waiter is not None and waited is not None:
            waiter.wait_stream(waited)

    def record_event(self, stream: Any, purpose: str) -> Any:
        """An event marking the work queued on ``stream`` so far (``None`` without streams)."""
        if stream is None:
            return None
        return stream.record_event()

    def wait_event(self, stream: Any, event: Any) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)

    def wait_for_host(self) -> None:
        """Block the host until the device finished all work queued on the current stream: the CPU
        reads what a kernel wrote into pinned host memory (CPU offload's gradients) only after it."""
        if self.uses_streams:
            torch.cuda.current_stream(self.device).synchronize()

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator ``tensor`` is used on ``stream`` (no-op without streams)."""
        if stream is not None and tensor.device.type == "cuda":
            tensor.record_stream(stream)


def make_device_handle(device: torch.device) -> DeviceHandle:
    """The handle a new communication context uses; tests swap in a recording stand-in here."""
    return DeviceHandle(device)
