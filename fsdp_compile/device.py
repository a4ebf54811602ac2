"""Streams and events behind one interface, so CPU+gloo and CUDA+NCCL share all runtime logic.

[Note: overlap without streams]
Collectives are always issued with ``async_op=True`` and waited on at first use. On CPU
the gloo backend runs them on its own thread, which overlaps them with compute; there are
no streams, so every stream operation here is a no-op. On CUDA the copy-in kernels run on
side streams after waiting for the compute stream, and NCCL's ``work.wait()`` makes the
compute stream (not the CPU) wait, so the CPU runs ahead and issues the next all-gather
while the GPU computes.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["DeviceHandle"]


class DeviceHandle:
    """The few device operations the runtime uses: side streams, cross-stream waits, memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.uses_streams = device.type == "cuda"
        self._streams: dict[str, torch.cuda.Stream] = {}

    def side_stream(self, purpose: str) -> torch.cuda.Stream | None:
        """A dedicated stream per purpose ("all_gather", "reduce_scatter"); ``None`` without streams."""
        if not self.uses_streams:
            return None
        if purpose not in self._streams:
            # Higher priority so communication copies are not starved by compute kernels.
            self._streams[purpose] = torch.cuda.Stream(device=self.device, priority=-1)
        return self._streams[purpose]

    @contextlib.contextmanager
    def on_stream(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        """Run the block on ``stream`` after it has waited for the current stream's work."""
        if stream is None:
            yield
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield

    def current_stream_waits_for(self, stream: torch.cuda.Stream | None) -> None:
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)

    def keep_alive_on(self, tensor: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        """Tell the caching allocator ``tensor`` is used on ``stream`` (no-op without streams)."""
        if stream is not None and tensor.device.type == "cuda":
            tensor.record_stream(stream)

    def wait_event(self, event: torch.Event | None, stream: torch.cuda.Stream | None) -> None:
        if event is not None and stream is not None:
            stream.wait_event(event)
