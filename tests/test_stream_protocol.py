"""The CUDA stream protocol ([Note: stream protocol] in comm_context.py), checked on CPU.

A recording stand-in for the device handle logs every stream switch, event record and wait the
runtime asks for; the tests assert FSDP2's ordering on that log at world size 2. On CPU the real
handle makes all of these no-ops, so the same calls happen in the same order either way.
"""
from __future__ import annotations

import contextlib
import itertools

import torch
import torch.distributed as dist

import fsdp_compile.runtime.comm_context as comm_context
from fsdp_compile import fully_shard
from fsdp_compile.runtime.device import DeviceHandle
from fsdp_compile.models import next_token_loss
from fsdp_testing import build_reference, global_batches, local_part, shard_model

COMPUTE = "compute"


class _Named:
    def __init__(self, name: str) -> None:
        self.name = name


class RecordingHandle(DeviceHandle):
    """Streams and events are names; every operation is appended to ``log`` as a tuple."""

    def __init__(self, device: torch.device, log: list[tuple[str, ...]], counter: itertools.count) -> None:
        super().__init__(device)
        self.log = log
        self.counter = counter
        self.active = [_Named(COMPUTE)]

    def new_stream(self, name: str) -> _Named:
        return _Named(name)

    def current_stream(self) -> _Named:
        return self.active[-1]

    @contextlib.contextmanager
    def on_stream(self, stream, phase: str):
        self.active.append(stream)
        self.log.append(("run", stream.name, phase))
        try:
            yield
        finally:
            self.active.pop()

    def wait_stream(self, waiter, waited) -> None:
        if waiter is not waited:
            self.log.append(("wait_stream", waiter.name, waited.name))

    def record_event(self, stream, purpose: str) -> _Named:
        event = _Named(f"{purpose}#{next(self.counter)}")
        self.log.append(("record", stream.name, event.name))
        return event

    def wait_event(self, stream, event) -> None:
        if event is not None:
            self.log.append(("wait_event", stream.name, event.name))

    def keep_alive(self, tensor, stream) -> None:
        pass


def _record_steps(steps: int, post_optim_event_on_step: int | None = None):
    """The protocol log of each training step of a 3-layer model (forward and backward)."""
    log: list[tuple[str, ...]] = []
    counter = itertools.count()
    original = comm_context.make_device_handle
    comm_context.make_device_handle = lambda device: RecordingHandle(device, log, counter)
    try:
        model = shard_model(build_reference(), fully_shard)
        batches = global_batches(steps, 2, dist.get_world_size())
        per_step = []
        for step, batch in enumerate(batches):
            tokens = local_part(batch)
            if step == post_optim_event_on_step:
                model.set_post_optim_event(_Named("post_optim"))
            start = len(log)
            next_token_loss(model(tokens), tokens).backward()
            per_step.append(log[start:])
        return per_step
    finally:
        comm_context.make_device_handle = original


def _events_in_order(entries, *wanted) -> bool:
    """Whether ``wanted`` entries appear in ``entries`` in this order (not necessarily adjacent)."""
    position = 0
    for entry in entries:
        if position < len(wanted) and entry == wanted[position]:
            position += 1
    return position == len(wanted)


def test_all_gathers_follow_copy_in_then_all_gather_then_compute_wait(dist):
    step = dist.run(2, _record_steps, 2)[0][1]
    all_gather_events = [e for kind, stream, e in step if kind == "record" and stream == "all_gather" and e.startswith("all_gather#")]
    assert len(all_gather_events) == 4 + 3  # forward: root + 3 layers; backward re-gathers the 3 layers
    copy_ins = [(kind, stream) for kind, stream, phase in step if kind == "run" and phase == "all_gather_copy_in"]
    assert copy_ins == [("run", "all_gather_copy_in")] * 7, "implicit all-gathers copy in on the copy-in stream"
    for event in all_gather_events:
        issued = step.index(("record", "all_gather", event))
        # The all-gather stream waited for the copy-in just before its all-gather.
        assert step[issued - 2] == ("wait_stream", "all_gather", "all_gather_copy_in")
        assert step[issued - 1] == ("run", "all_gather", "all_gather")
        # The compute stream waits for the all-gather before the copy-out that follows.
        waited = step.index(("wait_event", COMPUTE, event))
        copy_out = next(i for i in range(waited, len(step)) if step[i][0] == "record" and step[i][2].startswith("all_gather_copy_out"))
        assert issued < waited < copy_out


def test_forward_keeps_at_most_two_all_gather_outputs_alive(dist):
    step = dist.run(2, _record_steps, 2)[0][1]
    forward_end = next(i for i, e in enumerate(step) if e[0] == "record" and e[2].startswith("gradients"))
    alive = peak = 0
    for kind, stream, name in step[:forward_end]:
        if kind == "run" and name == "all_gather_copy_in":
            alive += 1
            peak = max(peak, alive)
        elif kind == "wait_event" and stream == "all_gather_copy_in" and name.startswith("all_gather_copy_out"):
            alive -= 1  # the streams are ordered after that copy-out: its output is released
    assert peak == 2, f"at most two groups' all-gather outputs in flight, saw {peak}"


def test_reduce_scatter_waits_on_the_gradient_event_and_compute_waits_on_it(dist):
    step = dist.run(2, _record_steps, 1)[0][0]
    gradient_events = [e for kind, stream, e in step if kind == "record" and stream == COMPUTE and e.startswith("gradients")]
    assert len(gradient_events) == 4  # root + 3 layers
    for event in gradient_events:
        at = step.index(("record", COMPUTE, event))
        assert step[at + 1] == ("wait_event", "reduce_scatter", event)
        assert step[at + 2] == ("run", "reduce_scatter", "reduce_scatter_copy_in")
        assert step[at + 3] == ("run", "reduce_scatter", "reduce_scatter")
        reduce_event = step[at + 4]
        assert reduce_event[:2] == ("record", "reduce_scatter")
        assert ("wait_event", COMPUTE, reduce_event[2]) in step[at + 5 :], "copy-out waits for the reduce-scatter"


def test_root_pre_forward_orders_all_gathers_after_compute_once_or_after_the_post_optim_event(dist):
    steps = dist.run(2, _record_steps, 3, 1)[0]
    waits_on_compute = [[e for e in step if e[0] == "wait_stream" and e[2] == COMPUTE] for step in steps]
    once = [("wait_stream", "all_gather_copy_in", COMPUTE), ("wait_stream", "all_gather", COMPUTE)]
    # Steps without an event: the all-gather streams wait on compute once, at the root's pre-forward,
    # before the first copy-in; later groups' copy-ins do not wait on compute again.
    assert waits_on_compute[0] == once and waits_on_compute[2] == once
    assert steps[0].index(once[1]) < steps[0].index(("run", "all_gather_copy_in", "all_gather_copy_in"))
    # With set_post_optim_event: the streams wait on that event instead of on compute.
    assert waits_on_compute[1] == []
    assert steps[1][:2] == [("wait_event", "all_gather_copy_in", "post_optim"), ("wait_event", "all_gather", "post_optim")]
    assert _events_in_order(steps[1], steps[1][1], ("run", "all_gather_copy_in", "all_gather_copy_in"))
