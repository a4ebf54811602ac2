"""benchmarks/cost_model.py: the two-stream replay on hand-built schedules, and schedules read from
graphs of a tiny model traced with a fake process group (world 8 and 64), in one process."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.cost_model import (
    Compute, Issue, Wait, schedule_from_graph, simulate, simulate_step, trace_graphs,
)
from fsdp_compile.config import PassConfig
from fsdp_compile.models import Transformer
from fsdp_compile.passes.graph import COLLECTIVES, WAIT
from test_passes_bucket import CONFIG, _traced

BATCH, SEQ = 2, 8  # the tokens of test_passes_bucket.py's traces, whose CONFIG this is
NO_PASSES = PassConfig(bucket=False, reorder=False)
BUCKET = PassConfig(bucket=True, reorder=False)

LINK, LATENCY, FLOPS, MEMORY = 50e9, 10e-6, 400e12, 3e12
RATES = dict(link_bytes_per_s=LINK, latency_s=LATENCY, flops_per_s=FLOPS, mem_bytes_per_s=MEMORY)
GIB = 2**30


def _ring(world: int, nbytes: float) -> float:
    """The ring all-gather / reduce-scatter time the model promises, written out independently."""
    return (world - 1) * LATENCY + (world - 1) / world * nbytes / LINK


# --- simulate on hand-built schedules ------------------------------------------------------------


@pytest.mark.parametrize("world", [8, 64, 1024])
def test_collective_waited_right_after_issue_is_fully_exposed(world):
    result = simulate([Issue("all_gather", GIB), Wait(0)], world, **RATES)
    assert result.exposed_s == pytest.approx(_ring(world, GIB), rel=1e-12)
    assert result.step_s == pytest.approx(result.exposed_s, rel=1e-12)
    assert result.compute_s == 0


def test_collective_issued_before_longer_compute_is_hidden():
    hiding = Compute("mm", flops=2 * _ring(64, GIB) * FLOPS)
    result = simulate([Issue("all_gather", GIB), hiding, Wait(0)], 64, **RATES)
    assert result.exposed_s == 0
    assert result.step_s == pytest.approx(2 * _ring(64, GIB), rel=1e-12)


def test_comm_stream_runs_collectives_one_after_another():
    ring = _ring(64, GIB)
    # Both issued at 0: the second only starts when the first is done, so it ends at 2 * ring,
    # and compute that ends at 1 * ring still waits a full ring for it.
    events = [Issue("all_gather", GIB), Issue("reduce_scatter", GIB), Compute("mm", flops=ring * FLOPS), Wait(1)]
    result = simulate(events, 64, **RATES)
    assert result.exposed_s == pytest.approx(ring, rel=1e-9)
    assert result.step_s == pytest.approx(2 * ring, rel=1e-9)
    assert result.comm_s == pytest.approx(2 * ring, rel=1e-12)


def test_all_reduce_takes_twice_a_reduce_scatter():
    scatter = simulate([Issue("reduce_scatter", GIB), Wait(0)], 16, **RATES)
    reduce = simulate([Issue("all_reduce", GIB), Wait(0)], 16, **RATES)
    assert reduce.exposed_s == pytest.approx(2 * scatter.exposed_s, rel=1e-12)


def test_collective_still_in_flight_at_graph_end_is_exposed():
    ring = _ring(64, GIB)
    result = simulate([Issue("reduce_scatter", GIB), Compute("mm", flops=0.25 * ring * FLOPS)], 64, **RATES)
    assert result.exposed_s == pytest.approx(0.75 * ring, rel=1e-9)
    assert result.step_s == pytest.approx(ring, rel=1e-9)


def test_memory_bound_op_takes_its_bytes_over_memory_bandwidth():
    result = simulate([Compute("add", flops=1e6, bytes=3 * GIB)], 8, **RATES)
    assert result.compute_s == pytest.approx(3 * GIB / MEMORY, rel=1e-12)
    assert result.memory_bound_s == result.compute_s


def test_wait_before_its_issue_is_rejected():
    with pytest.raises(ValueError, match="not an earlier Issue"):
        simulate([Wait(1), Issue("all_gather", GIB)], 8, **RATES)


# --- schedules of traced graphs ------------------------------------------------------------------


def _graphs(passes: PassConfig):
    """(forward, backward) of the tiny model at the fake process group's world size, with ``passes``:
    test_passes_bucket.py's traces, which its tests and test_compile_graphs.py's share (see [Note:
    traced once, passes on copies] there); trace_graphs yields the same graphs
    (test_trace_graphs_of_fake_tensors_are_the_graphs_of_a_real_trace)."""
    _, forward, backward = _traced(passes)
    return forward, backward


def _nodes(gm) -> list[tuple]:
    """Each node's op, target and value's shape and dtype: the graph without its names and values."""
    described = []
    for node in gm.graph.nodes:
        values = node.meta.get("val")
        values = values if isinstance(values, (list, tuple)) else [values]
        layout = [(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__ for v in values]
        described.append((node.op, str(node.target) if node.op == "call_function" else "", layout))
    return described


# A trace of its own, at one world size: 64, where most of the tiny model's shards are padded.
@pytest.mark.parametrize("fake_world", [64], indirect=True)
def test_trace_graphs_of_fake_tensors_are_the_graphs_of_a_real_trace(fake_world):
    # trace_graphs builds the model under FakeTensorMode (an 8B model traces on a laptop): node for
    # node the graphs of the same model traced with real parameters, whose schedules the tests below read.
    traced = trace_graphs(CONFIG, NO_PASSES, batch=BATCH, seq=SEQ, param_dtype=torch.float32)
    for fake, real in zip(traced, _graphs(NO_PASSES), strict=True):
        assert sum(t in COLLECTIVES for t in (n.target for n in fake.graph.nodes)) > 0
        assert _nodes(fake) == _nodes(real)


@pytest.mark.parametrize("passes", [NO_PASSES, BUCKET], ids=["no-passes", "bucket"])
def test_schedule_has_one_issue_per_collective_and_one_wait_per_wait_node(fake_world, passes):
    for gm in _graphs(passes):
        events = schedule_from_graph(gm)
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        collectives = sum(t in COLLECTIVES for t in targets)
        assert collectives > 0
        assert sum(isinstance(e, Issue) for e in events) == collectives
        waits = [e for e in events if isinstance(e, Wait)]
        assert len(waits) == targets.count(WAIT)
        assert all(isinstance(events[w.issue], Issue) for w in waits)


def test_forward_flops_equal_flop_counter_plus_causal_attention(fake_world):
    forward, _ = _graphs(NO_PASSES)
    modelled = sum(e.flops for e in schedule_from_graph(forward) if isinstance(e, Compute))

    # Reference: FlopCounterMode on the plain (unsharded, eager) model's forward for matmuls...
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ))
    with FlopCounterMode(display=False) as counter:
        Transformer(CONFIG)(tokens)
    matmuls = sum(count for op, count in counter.get_flop_counts()["Global"].items() if "attention" not in str(op))
    # ...and attention by hand: QK^T and PV, 2 * b * s * s * dim FLOPs each, half under the causal mask.
    attention = CONFIG.n_layers * 2 * (2 * BATCH * SEQ * SEQ * CONFIG.dim) * 0.5
    assert matmuls > 0
    assert modelled == pytest.approx(matmuls + attention, rel=1e-9)


def test_bucketing_exposes_less_communication_than_per_parameter_collectives(fake_world):
    per_param = simulate_step([schedule_from_graph(g) for g in _graphs(NO_PASSES)], fake_world)
    bucketed = simulate_step([schedule_from_graph(g) for g in _graphs(BUCKET)], fake_world)
    assert 0 < bucketed.exposed_s < per_param.exposed_s
    for result in (per_param, bucketed):
        assert result.step_s == pytest.approx(result.compute_s + result.exposed_s, rel=1e-9)
