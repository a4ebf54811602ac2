"""CommContext: what every parameter group under one root shares to communicate.

[Note: stream protocol]
One context per root (made at the root's lazy init; a group used before that has its own), so
all groups' collectives are ordered on the same side streams, as in FSDP2:

- Root pre-forward, once per step: the all-gather copy-in and all-gather streams wait on the
  post-optimizer event when one was set (``set_post_optim_event``), else on the compute stream.
  Nothing else makes them wait on compute: a later group's copy-in reads sharded parameters that
  only the optimizer writes.
- All-gather (forward, backward, prefetches): copy-in on the copy-in stream; the all-gather
  stream waits on it and all-gathers; an event marks the all-gather. Explicit ``unshard()`` runs
  both on the current stream.
- Copy-out: the compute stream waits on that event, then copies out. In forward the all-gather
  output is kept until the next group's copy-out, whose wait first makes the all-gather streams
  wait on this copy-out: the streams never run more than one all-gather ahead, so at most two
  groups' all-gather outputs are alive. Elsewhere the streams wait on the copy-out at once.
- Reduce-scatter: the compute stream records a "gradients" event after backward computed them;
  the reduce-scatter stream waits on it, copies in, reduce-scatters and records an event. The
  copy-out into the sharded gradients waits for it on the compute stream, when the reduction is
  finished: before the next group's reduce-scatter is issued (at most
  ``set_reduce_scatter_max_input_buffers`` in flight, default one, bound the buffers' memory)
  and at the end of backward (or at the next root forward with ``set_is_last_backward(False)``).

On CPU every stream and event is ``None`` and each step above is a no-op; the order of calls is
the same, which is what the tests check with a recording handle.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from fsdp_compile.runtime.device import DeviceHandle, make_device_handle

__all__ = ["CommContext", "ReducingGroup", "InFlightAllGather"]


class ReducingGroup(Protocol):
    """What the context asks of a group with a reduce-scatter in flight (an ``FSDPParamGroup``).
    A protocol, not the class: the context sits below the groups and imports none of their layer."""

    def finish_reduction(self) -> None: ...


class InFlightAllGather(Protocol):
    """An all-gather in flight (``collectives.PendingAllGather``), as the context keeps it."""

    overlapped: bool


# Why an all-gather was issued -> whether it runs on the side streams (implicit, overlapped).
_OVERLAPPED_REASONS = ("forward", "forward-prefetch", "backward", "backward-prefetch")


class CommContext:
    """Side streams, the all-gather awaiting release, the reductions in flight, the post-optimizer event."""

    def __init__(self, device: torch.device, handle: DeviceHandle | None = None) -> None:
        self.device = device
        self.handle = handle if handle is not None else make_device_handle(device)
        self._streams: dict[str, Any] = {}
        # Forward's last all-gather: released after the next copy-out (see the note).
        self._previous_all_gather: tuple[InFlightAllGather, Any] | None = None
        # Groups with a reduce-scatter in flight, oldest first.
        self.reducing_groups: list[ReducingGroup] = []
        self.post_optim_event: Any = None

    def _stream(self, name: str) -> Any:
        if name not in self._streams:
            self._streams[name] = self.handle.new_stream(name)
        return self._streams[name]

    @property
    def all_gather_copy_in_stream(self) -> Any:
        return self._stream("all_gather_copy_in")

    @property
    def all_gather_stream(self) -> Any:
        return self._stream("all_gather")

    @property
    def reduce_scatter_stream(self) -> Any:
        return self._stream("reduce_scatter")

    def all_gather_streams(self, reason: str) -> tuple[Any, Any]:
        """(copy-in stream, all-gather stream) for an all-gather issued for ``reason``."""
        if reason in _OVERLAPPED_REASONS:
            return self.all_gather_copy_in_stream, self.all_gather_stream
        current = self.handle.current_stream()
        return current, current

    # --- protocol steps (see the note) -----------------------------------------------------------
    def begin_step(self) -> None:
        """Root pre-forward: the all-gather streams wait on the post-optim event, else on compute."""
        streams = (self.all_gather_copy_in_stream, self.all_gather_stream)
        if self.post_optim_event is not None:
            for stream in streams:
                self.handle.wait_event(stream, self.post_optim_event)
            self.post_optim_event = None
        else:
            current = self.handle.current_stream()
            for stream in streams:
                self.handle.wait_stream(stream, current)

    def all_gather_streams_wait(self, event: Any) -> None:
        for stream in (self.all_gather_copy_in_stream, self.all_gather_stream):
            self.handle.wait_event(stream, event)

    def before_copy_out(self, in_forward: bool) -> None:
        """Release forward's previous all-gather output once the streams are ordered after its copy-out."""
        if in_forward and self._previous_all_gather is not None:
            _, copy_out_event = self._previous_all_gather
            self.all_gather_streams_wait(copy_out_event)
            self._previous_all_gather = None

    def after_copy_out(self, pending: InFlightAllGather, in_forward: bool) -> None:
        event = self.handle.record_event(self.handle.current_stream(), "all_gather_copy_out")
        if in_forward and pending.overlapped:
            self._previous_all_gather = (pending, event)
        else:
            self.all_gather_streams_wait(event)

    def finish_reductions(self, keep: int = 0) -> None:
        """Land reduce-scatters in flight into the sharded gradients, oldest first, until ``keep`` remain."""
        while len(self.reducing_groups) > keep:
            self.reducing_groups.pop(0).finish_reduction()

    def release(self) -> None:
        """End of backward: nothing of forward's all-gathers is kept."""
        if self._previous_all_gather is not None:
            self.all_gather_streams_wait(self._previous_all_gather[1])
            self._previous_all_gather = None
