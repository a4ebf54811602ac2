"""Exposed-communication cost model: replay the compiled FSDP schedule for N ranks on paper.

``python -m benchmarks.cost_model`` traces an 8B-shaped Llama through ``backend="fsdp_aot_eager"``
under ``FakeTensorMode`` with a fake process group (no compute, no communication happens), once
per pass configuration, and replays the partitioned forward and backward graphs node by node
on a two-stream machine model for every world size asked for. It prints, per world size and
configuration, the modelled step time and how much of it the compute stream spends blocked on
communication; ``--results-md`` writes the same as a section of ``benchmarks/RESULTS.md``.

The machine model (see [Note: two-stream replay])::

    compute event   time = max(flops / flops_per_s, bytes / mem_bytes_per_s)    in graph order
    issue event     starts at max(issue time, comm stream free); FIFO, one comm stream
                    all-gather, reduce-scatter: (N-1)*latency + (N-1)/N * unsharded_bytes / link_bw
                    all-reduce: twice that
    wait event      compute stream blocks until its collective is done: that block is exposed

Defaults, and why:

- link 50 GB/s per rank: a 400 Gb/s NIC per GPU (InfiniBand NDR / 400GbE), the usual
  inter-node bandwidth of an H100 cluster, and the bandwidth the project's target names;
- latency 10 us per ring hop: network latency plus NCCL's per-step kernel/proxy overhead
  between nodes, the order of magnitude NCCL's own tuning model assumes for inter-node rings;
- 400 TFLOP/s effective bf16 compute: about 40% of an H100 SXM's dense bf16 peak (989), the
  model FLOPs utilisation well-tuned Llama training reaches;
- 3 TB/s memory bandwidth: an H100 SXM's HBM3 (3.35 TB/s peak) less what kernels do not reach;
- batch 1 x seq 8192 per rank: Llama-3-8B's training context, one sequence per rank (the
  smallest per-rank compute a step at this context can have, so the least to hide behind);
- bf16 parameters, and gradients reduced in bf16 (``MixedPrecisionPolicy``'s reduce dtype
  defaults to the parameter dtype); ``--reduce-dtype fp32`` doubles the reduce-scatter bytes.

Example::

    python -m benchmarks.cost_model --worlds 64 --layers 4        # a quick look, 4 blocks
    python -m benchmarks.cost_model --results-md benchmarks/RESULTS.md
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

import fsdp_compile
from fsdp_compile.config import PassConfig
from fsdp_compile.models import Transformer, TransformerConfig
from fsdp_compile.passes.graph import (
    COLLECTIVE_NAMES, GROUP_KEY, WAIT, collective_bytes, fsdp_annotation, is_view, tensor_bytes,
)

__all__ = [
    "Compute", "Issue", "Wait", "Event", "Result", "Hardware", "LLAMA_8B", "CONFIGURATIONS",
    "ring_time", "schedule_from_graph", "simulate", "simulate_step",
    "fake_process_group", "trace_graphs", "main",
]

GB = 1e9
SECTION_KEY = "cost-model"
DEFAULT_WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
# Collective bytes are world-independent (see [Note: one trace, every world size]); 64 is where
# the target is stated, so its padding is the one the traced shapes carry.
TRACE_WORLD = 64
TARGET_WORLD = 64
TARGET_LINK_BYTES_PER_S = 50 * GB
TARGET_EXPOSED_FRACTION = 0.10

# Llama-3-8B's shape (grouped-query attention aside: our model has as many KV heads as heads,
# which adds 0.8B parameters to the attention projections: 8.84B in all).
LLAMA_8B = TransformerConfig(
    vocab_size=128256, dim=4096, n_layers=32, n_heads=32, ffn_hidden=14336, max_seq_len=8192, tie_embeddings=False,
)

# Insertion order is table order.
CONFIGURATIONS: dict[str, PassConfig] = {
    "no passes": PassConfig(bucket=False, reorder=False),
    "bucket": PassConfig(bucket=True, reorder=False),
    "bucket + reorder": PassConfig(bucket=True, reorder=True),
}
# --comm-policy: the full passes with each CommPolicy beside today's wire.
COMM_POLICIES: dict[str, "fsdp_compile.CommPolicy"] = {
    "int8 all-gather": fsdp_compile.CommPolicy(all_gather_dtype=torch.int8),
    "bf16 wire, fp32 sum": fsdp_compile.CommPolicy(reduce_wire_dtype=torch.bfloat16),
    "int8 AG + bf16 wire": fsdp_compile.CommPolicy(all_gather_dtype=torch.int8, reduce_wire_dtype=torch.bfloat16),
}


# --- Events --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Compute:
    """One op on the compute stream."""

    op: str
    flops: float = 0.0
    bytes: int = 0  # read + written; 0 for views


@dataclass(frozen=True)
class Issue:
    """A collective handed to the comm stream; the compute stream goes on at once."""

    collective: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    bytes: int  # unsharded: all-gather output, reduce-scatter input, all-reduce tensor
    group: str | None = None  # the fully_shard group (bucket) it belongs to


@dataclass(frozen=True)
class Wait:
    """The compute stream blocks until the collective at position ``issue`` of the schedule is done."""

    issue: int


Event = Compute | Issue | Wait


@dataclass(frozen=True)
class Hardware:
    """Per-rank rates of the machine model; defaults and their reasons are in the module docstring."""

    link_bytes_per_s: float = 50 * GB
    latency_s: float = 10e-6
    flops_per_s: float = 400e12
    mem_bytes_per_s: float = 3e12


@dataclass(frozen=True)
class Result:
    """Modelled times of one schedule (or, summed with ``+``, of a step's schedules)."""

    step_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0  # time the comm stream is busy, hidden or not
    exposed_s: float = 0.0  # time the compute stream is blocked on communication
    memory_bound_s: float = 0.0  # part of compute_s in ops limited by memory bandwidth, not FLOPs

    @property
    def exposed_fraction(self) -> float:
        return self.exposed_s / self.step_s if self.step_s else 0.0

    def __add__(self, other: "Result") -> "Result":
        return Result(**{name: getattr(self, name) + getattr(other, name) for name in self.__dataclass_fields__})


# --- Graph -> schedule ---------------------------------------------------------------------------

_aten = torch.ops.aten
# The graphs are traced on CPU, so attention appears as the CPU flash kernels, which the FLOP
# registry lacks; they compute what the CUDA flash kernels (registered) compute, and take the
# same leading (grad_out,) query, key, value arguments the registry's formulas read.
_FLOP_ALIASES = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _aten._scaled_dot_product_flash_attention_backward,
}
# The registry counts attention as a full square; causal flash kernels skip the masked half of
# the tiles. Counting the full square would overstate compute and so flatter the overlap.
CAUSAL_ATTENTION_FRACTION = 0.5


def _argument(node: fx.Node, name: str) -> Any:
    """Argument ``name`` of an aten call, positional, keyword or schema default."""
    for position, argument in enumerate(node.target._schema.arguments):
        if argument.name == name:
            if position < len(node.args):
                return node.args[position]
            return node.kwargs.get(name, argument.default_value)
    return None


def _flops(node: fx.Node) -> float:
    if not isinstance(node.target, torch._ops.OpOverload):
        return 0.0
    packet = node.target.overloadpacket
    formula = flop_registry.get(_FLOP_ALIASES.get(packet, packet))
    if formula is None:
        return 0.0
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    flops = float(formula(*args, **kwargs, out_val=node.meta.get("val")))
    if _argument(node, "is_causal") is True:
        flops *= CAUSAL_ATTENTION_FRACTION
    return flops


def schedule_from_graph(gm: fx.GraphModule) -> list[Event]:
    """The compute and collective events of a partitioned forward or backward graph, in graph order.

    Expects ``_c10d_functional`` collectives each waited on by a ``wait_tensor`` later in the
    graph (what ``fsdp_aot_eager`` produces, with or without our passes), and fake tensors in
    ``node.meta["val"]``. FLOPs come from ``torch.utils.flop_counter``'s registry (0 for ops it
    does not know: pointwise ops are bound by memory traffic anyway); bytes are the op's input
    and output tensors (0 for views).

    Example::

        with observe_graphs() as graphs:
            torch.compile(model, backend="fsdp_aot_eager")(tokens).sum().backward()
        events = schedule_from_graph(next(g for kind, g in graphs if kind == "backward"))
    """
    events: list[Event] = []
    issued: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is WAIT:
            collective = node.args[0]
            if collective not in issued:
                raise ValueError(f"cost_model: {node.name} waits on {collective}, which is not a collective issued earlier")
            events.append(Wait(issued[collective]))
        elif node.target in COLLECTIVE_NAMES:
            kind = COLLECTIVE_NAMES[node.target]
            group = (fsdp_annotation(node) or {}).get(GROUP_KEY)
            issued[node] = len(events)
            events.append(Issue(kind, collective_bytes(node), group))
        elif node.target is torch.ops.higher_order.invoke_subgraph:
            # A block compiled once (a nested region): its body's ops run here, in its order.
            events.extend(schedule_from_graph(getattr(gm, node.args[0].target)))
        elif getattr(node.target, "namespace", None) == "_c10d_functional":
            raise ValueError(f"cost_model: no cost formula for {node.target} ({node.name}); add it to passes/graph.py's COLLECTIVE_NAMES")
        else:
            nbytes = 0 if is_view(node) else tensor_bytes(node.meta.get("val")) + sum(
                tensor_bytes(i.meta.get("val")) for i in node.all_input_nodes
            )
            events.append(Compute(getattr(node.target, "__name__", str(node.target)), _flops(node), nbytes))
    return events


# --- Replay --------------------------------------------------------------------------------------


def ring_time(collective: str, unsharded_bytes: float, world_size: int, link_bytes_per_s: float, latency_s: float) -> float:
    """Seconds a ring collective over ``world_size`` ranks takes.

    Example: ``ring_time("all_gather", 2**30, 64, 50e9, 10e-6)`` is 63 hops of 10 us plus 63/64
    of a GiB at 50 GB/s, about 21.8 ms.
    """
    if world_size <= 1:
        return 0.0
    steps = world_size - 1
    one_pass = steps * latency_s + steps / world_size * unsharded_bytes / link_bytes_per_s
    if collective == "all_reduce":
        return 2 * one_pass  # reduce-scatter then all-gather
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        # all_to_all (CommPolicy's gradient wire): each rank sends (N-1)/N of its buffer, N-1 exchanges.
        return one_pass
    raise ValueError(f"cost_model: unknown collective {collective!r}")


# [Note: two-stream replay]
# One compute stream runs compute events back to back in graph order; one comm stream runs
# collectives FIFO in issue order, each starting when it is issued or when the previous one
# finishes, whichever is later (FSDP issues all its collectives on one process group, and a
# ring saturates the link, so two in flight would not go faster). A wait stalls the compute
# stream until its collective is done; the stall is the exposed communication. Whatever is still
# in flight at the end of a graph is waited on there too: the next graph (backward after
# forward, the optimizer after backward) reads the gathered parameters or the reduced gradients.
# So step_s == compute_s + exposed_s, and graphs can be replayed one at a time and summed.


def simulate(
    events: Sequence[Event],
    world_size: int,
    link_bytes_per_s: float = Hardware.link_bytes_per_s,
    latency_s: float = Hardware.latency_s,
    flops_per_s: float = Hardware.flops_per_s,
    mem_bytes_per_s: float = Hardware.mem_bytes_per_s,
) -> Result:
    """Replay one graph's ``events`` on the two-stream model of [Note: two-stream replay].

    Example::

        events = [Issue("all_gather", 2**30), Compute("mm", flops=8e12), Wait(0)]
        simulate(events, world_size=64).exposed_s    # 0.0: the 20 ms compute hides the gather
    """
    now = comm_free = compute = comm = exposed = memory_bound = 0.0
    done_at: dict[int, float] = {}
    for index, event in enumerate(events):
        if isinstance(event, Compute):
            flop_time, memory_time = event.flops / flops_per_s, event.bytes / mem_bytes_per_s
            duration = max(flop_time, memory_time)
            now += duration
            compute += duration
            if memory_time > flop_time:
                memory_bound += duration
        elif isinstance(event, Issue):
            duration = ring_time(event.collective, event.bytes, world_size, link_bytes_per_s, latency_s)
            comm_free = max(now, comm_free) + duration
            done_at[index] = comm_free
            comm += duration
        elif isinstance(event, Wait):
            if event.issue not in done_at:
                raise ValueError(f"cost_model: event {index} waits on event {event.issue}, which is not an earlier Issue")
            if done_at[event.issue] > now:
                exposed += done_at[event.issue] - now
                now = done_at[event.issue]
        else:
            raise TypeError(f"cost_model: not an event: {event!r}")
    if comm_free > now:
        exposed += comm_free - now
        now = comm_free
    return Result(step_s=now, compute_s=compute, comm_s=comm, exposed_s=exposed, memory_bound_s=memory_bound)


def simulate_step(schedules: Sequence[Sequence[Event]], world_size: int, hardware: Hardware = Hardware()) -> Result:
    """A training step: the schedules (forward, backward) replayed back to back."""
    total = Result()
    for events in schedules:
        total = total + simulate(events, world_size, **asdict(hardware))
    return total


# --- Tracing -------------------------------------------------------------------------------------


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """This process as rank 0 of ``world_size`` fake ranks: collectives trace but never run."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "cost_model: a process group is already initialized; run python -m benchmarks.cost_model in a fresh process"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def trace_graphs(
    model_config: TransformerConfig,
    passes: PassConfig,
    batch: int = 1,
    seq: int = 8192,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype | None = None,
    comm_policy: "fsdp_compile.CommPolicy | None" = None,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """(forward, backward) graphs ``fsdp_aot_eager`` compiles for one step of ``model_config``.

    Every block and the root are ``fully_shard``-ed over the current (fake) process group; the
    model, its parameters and the tokens are fake tensors, so an 8B model traces on a laptop.

    Example::

        with fake_process_group(64):
            forward, backward = trace_graphs(LLAMA_8B, PassConfig(bucket=True, reorder=False))
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compile.compile.backend import observe_graphs

    if not dist.is_initialized():
        raise RuntimeError("cost_model: trace_graphs needs a process group; wrap it in fake_process_group(world_size)")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # a real object: outside FakeTensorMode
    policy = fsdp_compile.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    previous = fsdp_compile.config.passes
    fsdp_compile.config.passes = passes
    torch._dynamo.reset()  # the same model class would otherwise hit Dynamo's cache from the last trace
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = Transformer(model_config)
            comm = comm_policy if comm_policy is not None else fsdp_compile.CommPolicy()
            for block in model.layers:
                fsdp_compile.fully_shard(block, mesh=mesh, mp_policy=policy, comm_policy=comm)
            fsdp_compile.fully_shard(model, mesh=mesh, mp_policy=policy, comm_policy=comm)
            tokens = torch.randint(0, model_config.vocab_size, (batch, seq))
            with observe_graphs() as graphs:
                torch.compile(model, backend="fsdp_aot_eager", fullgraph=True)(tokens).float().sum().backward()
    finally:
        fsdp_compile.config.passes = previous
        torch._dynamo.reset()
    # Dynamo may compile small side graphs as well; the model's forward is the largest.
    forward = max((g for kind, g in graphs if kind == "forward"), key=lambda g: len(g.graph.nodes))
    backward = next(g for kind, g in graphs if kind == "backward")
    return forward, backward


# --- Report --------------------------------------------------------------------------------------


@dataclass
class _Row:
    world: int
    configuration: str
    result: Result


@dataclass
class _Run:
    command: str
    model_config: TransformerConfig
    hardware: Hardware
    worlds: tuple[int, ...]
    batch: int
    seq: int
    reduce_dtype: str
    trace_world: int
    rows: list[_Row] = field(default_factory=list)
    trace_s: dict[str, float] = field(default_factory=dict)
    collectives: dict[str, str] = field(default_factory=dict)


_HEADER = "| world | passes | step ms | compute ms | comm ms | exposed ms | exposed % |"


def _table(rows: list[_Row]) -> str:
    columns = _HEADER.count(" | ")
    lines = [_HEADER, "|" + "---|" * (columns + 1)]
    for row in rows:
        r = row.result
        cells = [f"{row.world}", row.configuration, f"{r.step_s * 1e3:,.0f}", f"{r.compute_s * 1e3:,.0f}",
                 f"{r.comm_s * 1e3:,.0f}", f"{r.exposed_s * 1e3:,.0f}", f"{r.exposed_fraction * 100:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _target_line(run: _Run) -> str:
    target = (f"exposed communication <= {TARGET_EXPOSED_FRACTION:.0%} of the step at {TARGET_WORLD} ranks "
              f"with {TARGET_LINK_BYTES_PER_S / GB:.0f} GB/s links")
    if TARGET_WORLD not in run.worlds or run.hardware.link_bytes_per_s != TARGET_LINK_BYTES_PER_S:
        return f"Target ({target}): not evaluated, this run models other world sizes or links."
    verdicts = []
    for row in run.rows:
        if row.world != TARGET_WORLD:
            continue
        met = "met" if row.result.exposed_fraction <= TARGET_EXPOSED_FRACTION else "not met"
        verdicts.append(f"{row.configuration}: {row.result.exposed_fraction:.1%}, {met}")
    default_shape = run.model_config == LLAMA_8B and (run.batch, run.seq) == (1, LLAMA_8B.max_seq_len)
    shape = "" if default_shape else (
        f" (on {run.model_config.n_layers} block{'s' if run.model_config.n_layers != 1 else ''}, "
        f"batch {run.batch} x seq {run.seq}: not the default 8B-shaped step)"
    )
    return f"Target ({target}){shape}: " + "; ".join(verdicts) + "."


def _parameters(model_config: TransformerConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(model_config).parameters())


_METHOD = """\
How the figures are modelled (`benchmarks/cost_model.py`): the forward and backward graphs that
`fsdp_aot_eager` compiles (AOTAutograd's partition, after our post-grad passes) are traced once
per configuration with fake tensors and a fake process group, and replayed node by node. Compute
ops run back to back on one stream, each taking max(FLOPs / compute rate, bytes read and written /
memory bandwidth); FLOPs come from `torch.utils.flop_counter`'s registry (CPU flash attention
counted as the CUDA flash kernel, halved for causal masking). Collectives run FIFO on one comm
stream from the moment they are issued, as rings: (N-1) x latency + (N-1)/N x unsharded bytes /
link bandwidth, twice that for all-reduce. A wait blocks compute until its collective is done;
exposed is the total blocked time, including collectives still in flight when a graph ends.
Step = forward + backward (no optimizer step). Per-rank compute is the same at every world size
(same local batch); collective bytes are the traced unsharded sizes at every world size.
Ops are counted as the unfused aot_eager graph runs them: Inductor fuses most memory-bound
pointwise ops, so real compute would be shorter than modelled and the exposed fraction higher."""


def _section(run: _Run, table: str) -> str:
    from benchmarks.report import git_commit

    cfg, hw = run.model_config, run.hardware
    head = "tied head" if cfg.tie_embeddings else "untied head"
    passes = "; ".join(f"{name} = `{config!r}`" for name, config in CONFIGURATIONS.items())
    # Compute does not depend on the world size: one row per configuration says it all.
    shares = [
        f"{row.configuration} {row.result.memory_bound_s * 1e3:,.0f} of {row.result.compute_s * 1e3:,.0f} ms"
        for row in run.rows if row.world == run.worlds[0] and row.result is not None
    ]
    memory_line = f"Compute in memory-bound ops: {'; '.join(shares)}.\n\n" if shares else ""
    traced = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in run.trace_s.items())
    collectives = "; ".join(f"{name}: {text}" for name, text in run.collectives.items())
    return (
        f"<!-- benchmark section: {SECTION_KEY} -->\n"
        "## Cost model: modelled exposed communication (not a measurement)\n\n"
        f"Command: `{run.command}`  \n"
        f"torch {torch.__version__}, Python {platform.python_version()}, {datetime.date.today().isoformat()}, "
        f"commit {git_commit()}.  \n"
        f"Model: {_parameters(cfg) / 1e9:.2f}B parameters (dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads, "
        f"ffn {cfg.hidden}, vocab {cfg.vocab_size}, {head}), batch {run.batch} x seq {run.seq} per rank, "
        f"bf16 parameters, {run.reduce_dtype} gradient reduction.  \n"
        f"Machine model per rank: {hw.link_bytes_per_s / GB:g} GB/s link, {hw.latency_s * 1e6:g} us per ring hop, "
        f"{hw.flops_per_s / 1e12:g} TFLOP/s, {hw.mem_bytes_per_s / 1e12:g} TB/s memory.  \n"
        f"Graphs traced at {run.trace_world} fake ranks ({traced}), replayed for every world size. "
        f"Configurations: {passes}.  \n"
        f"Collectives per step (forward + backward): {collectives}.\n\n"
        f"{table}\n\n"
        f"{_target_line(run)}\n\n"
        f"{memory_line}"
        f"{_METHOD}\n"
        f"<!-- end benchmark section: {SECTION_KEY} -->\n"
    )


def _count_collectives(schedules: Sequence[Sequence[Event]]) -> str:
    counts = {kind: 0 for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")}
    for events in schedules:
        for event in events:
            if isinstance(event, Issue):
                counts[event.collective] += 1
    return f"{sum(counts.values())} ({'/'.join(str(v) for v in counts.values())} AG/RS/AR/A2A)"


def _model(run: _Run, configurations: dict[str, PassConfig], policies: dict[str, "fsdp_compile.CommPolicy"] | None = None) -> None:
    """Trace each configuration (and each CommPolicy with all passes) once and replay it for every
    world size into ``run.rows``."""
    by_world: dict[int, list[_Row]] = {world: [] for world in run.worlds}
    reduce_dtype = {"bf16": None, "fp32": torch.float32}[run.reduce_dtype]
    traces = {name: (passes, None) for name, passes in configurations.items()}
    for name, policy in (policies or {}).items():
        traces[f"bucket + reorder, {name}"] = (PassConfig(bucket=True, reorder=True), policy)
    with fake_process_group(run.trace_world):
        for name, (passes, policy) in traces.items():
            started = time.perf_counter()
            graphs = trace_graphs(run.model_config, passes, run.batch, run.seq, reduce_dtype=reduce_dtype, comm_policy=policy)
            schedules = [schedule_from_graph(gm) for gm in graphs]
            del graphs  # tens of thousands of fake-tensor nodes; the next trace needs the memory
            run.trace_s[name] = time.perf_counter() - started
            run.collectives[name] = _count_collectives(schedules)
            print(f"cost_model: traced {name} in {run.trace_s[name]:.1f} s", file=sys.stderr)
            for world in run.worlds:
                by_world[world].append(_Row(world, name, simulate_step(schedules, world, run.hardware)))
    run.rows = [row for world in run.worlds for row in by_world[world]]


def _worlds(text: str) -> tuple[int, ...]:
    try:
        worlds = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 8,64,1024, got {text!r}") from None
    if not worlds or min(worlds) < 1:
        raise argparse.ArgumentTypeError("world sizes must be positive integers")
    return worlds


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    hw = Hardware()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.cost_model",
        description="Model step time and exposed communication of our compiled FSDP schedule for N ranks:\n"
        "trace an 8B-shaped Llama through backend=fsdp_aot_eager with fake tensors (no GPU, about a\n"
        "minute per configuration at 32 layers on CPU), replay its graphs on a compute stream and a\n"
        "FIFO ring-collective stream. Prints a Markdown table per world size and pass configuration.",
        epilog="Defaults describe an H100 cluster with one 400 Gb/s NIC per GPU; reasons in the module docstring\n"
        "(python -c 'import benchmarks.cost_model as m; help(m)').",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--worlds", type=_worlds, default=DEFAULT_WORLDS,
        help=f"comma-separated world sizes to model (default {','.join(map(str, DEFAULT_WORLDS))})")
    add("--link-gbps", type=float, default=hw.link_bytes_per_s / GB,
        help="per-rank link bandwidth in GB/s, gigaBYTES (default 50: a 400 Gb/s NIC per GPU)")
    add("--latency-us", type=float, default=hw.latency_s * 1e6,
        help="latency per ring hop in microseconds (default 10: inter-node network + NCCL step overhead)")
    add("--tflops", type=float, default=hw.flops_per_s / 1e12,
        help="effective bf16 compute in TFLOP/s (default 400: about 40%% of an H100's 989 dense peak)")
    add("--mem-tbps", type=float, default=hw.mem_bytes_per_s / 1e12,
        help="memory bandwidth in TB/s for memory-bound ops (default 3: an H100's HBM3, 3.35 peak)")
    add("--layers", type=int, default=LLAMA_8B.n_layers,
        help=f"transformer blocks (default {LLAMA_8B.n_layers}, the 8B shape; each configuration traces in about 2 s per block)")
    add("--seq", type=int, default=LLAMA_8B.max_seq_len, help=f"sequence length per rank (default {LLAMA_8B.max_seq_len})")
    add("--batch", type=int, default=1, help="sequences per rank (default 1)")
    add("--reduce-dtype", choices=["bf16", "fp32"], default="bf16",
        help="gradient reduce-scatter dtype (default bf16: MixedPrecisionPolicy's default, the parameter dtype)")
    add("--comm-policy", action="store_true",
        help=f"also model each CommPolicy with all passes: {'; '.join(COMM_POLICIES)}")
    add("--trace-world", type=int, default=TRACE_WORLD,
        help=f"fake world size the graphs are traced at (default {TRACE_WORLD}); collective bytes do not depend on it")
    add("--results-md", default=None, metavar="PATH",
        help=f"also write the '{SECTION_KEY}' section (command, parameters, table, target verdict) into PATH, "
        "e.g. benchmarks/RESULTS.md; other sections are kept")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.seq < 1 or args.batch < 1 or args.trace_world < 2:
        parser.error("--layers, --seq and --batch must be >= 1, --trace-world >= 2")
    return args


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m benchmarks.cost_model``."""
    from dataclasses import replace

    args = _parse_args(argv)
    run = _Run(
        command="python -m benchmarks.cost_model" + "".join(f" {a}" for a in (sys.argv[1:] if argv is None else argv)),
        model_config=replace(LLAMA_8B, n_layers=args.layers, max_seq_len=max(args.seq, 1)),
        hardware=Hardware(args.link_gbps * GB, args.latency_us * 1e-6, args.tflops * 1e12, args.mem_tbps * 1e12),
        worlds=args.worlds, batch=args.batch, seq=args.seq, reduce_dtype=args.reduce_dtype, trace_world=args.trace_world,
    )
    _model(run, CONFIGURATIONS, COMM_POLICIES if args.comm_policy else None)
    table = _table(run.rows)
    print(table)
    print("\n" + _target_line(run))
    if args.results_md:
        from benchmarks.report import write_results_md

        write_results_md(args.results_md, _section(run, table), SECTION_KEY)
        print(f"\nwrote the '{SECTION_KEY}' section in {args.results_md}")


if __name__ == "__main__":
    main()
