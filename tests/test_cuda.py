"""The CUDA path on one GPU at world size 1 (NCCL): what the CPU suite cannot run.

* Parity with the unsharded model, in fp32 and in bf16 mixed precision, for our eager runtime,
  the whole model compiled with block frames (the default) and as one graph of regions
  (``config.block_compile = "regions"``), and per-block compile (``block.compile``), plus
  our eager runtime against PyTorch's FSDP2 on the same GPU.
* The stream protocol ([Note: stream protocol] in fsdp_compile/comm_context.py) on real CUDA
  streams and events, and a few training steps under PyTorch's CUDA sanitizer (CSAN), which
  fails on any kernel reading or writing a tensor another stream may still be using.
* The Triton kernels (compiled, not interpreted) against their references run on the same CUDA
  tensors, bit for bit, small groups and one large one.
* CPU offload: pinned host shards and gradients, training as without offload; compiled (blocks as
  frames) training as the eager runtime with the same offload.

Without CUDA every test here is skipped at collection (no tensor is made). On a GPU machine,
``python -m benchmarks.gpu`` runs this file first (docs/gpu.md). World size 1 is what one GPU
gives: the runtime then issues no collective (a one-rank all-gather or reduce-scatter is the
identity), but every copy-in, copy-out, cast, stream and event is real.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import math
import subprocess
import sys
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_compile
import fsdp_compile.runtime.comm_context as comm_context
from conftest import REPO_DIR, TESTS_DIR, free_port
from fsdp_compile.runtime.device import DeviceHandle
from fsdp_compile.runtime.param_group import FSDPParamGroup
from fsdp_compile.models import Transformer, TransformerConfig, next_token_loss
from fsdp_testing import block_compile_mode, build_reference, global_batches, shard_model

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (on a GPU machine: python -m benchmarks.gpu, docs/gpu.md)"
)

# Big enough for real GPU kernels (tiled matmuls, several Triton blocks per copy), small enough to
# compile in seconds: 3 blocks, 64-wide heads.
CONFIG = TransformerConfig(vocab_size=512, dim=128, n_layers=3, n_heads=2, max_seq_len=64)
STEPS = 4


def _optimizer(parameters) -> torch.optim.Optimizer:
    # SGD: its update is proportional to the gradient, so a numeric gap stays proportional (AdamW's
    # first steps move each element by about lr whatever its gradient's size, sign flips included).
    # This rate moves the parameters by about 5e-2 in STEPS steps, far beyond every tolerance below.
    return torch.optim.SGD(parameters, lr=0.3, momentum=0.9)


@pytest.fixture(scope="module")
def cuda():
    """Rank 0 of a one-rank NCCL process group on GPU 0 for this module's tests."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield torch.device("cuda", 0)
    torch._dynamo.reset()
    dist.destroy_process_group()


# ---- parity with the unsharded model ---------------------------------------------------------------


def _batches(device: torch.device) -> list[torch.Tensor]:
    return [b.to(device) for b in global_batches(STEPS, 4, 1, CONFIG, seq=CONFIG.max_seq_len)]


def _train_unsharded(model: nn.Module, batches: list[torch.Tensor], bf16: bool) -> list[float]:
    """SGD on the unsharded model. bf16: what FSDP's mixed precision computes at world size 1:
    fp32 parameters cast to a bf16 copy each step (parameters only, buffers stay fp32), forward and
    backward in bf16, the bf16 gradients cast to fp32 for the update."""
    optimizer = _optimizer(model.parameters())
    low = copy.deepcopy(model) if bf16 else None
    if low is not None:
        for parameter in low.parameters():
            parameter.data = parameter.data.to(torch.bfloat16)
    losses = []
    for tokens in batches:
        runner = low if low is not None else model
        if low is not None:
            with torch.no_grad():
                for low_parameter, parameter in zip(low.parameters(), model.parameters()):
                    low_parameter.copy_(parameter)
        loss = next_token_loss(runner(tokens), tokens)
        loss.backward()
        if low is not None:
            for low_parameter, parameter in zip(low.parameters(), model.parameters()):
                parameter.grad, low_parameter.grad = low_parameter.grad.float(), None
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _train(model: nn.Module, runner: Callable, batches: list[torch.Tensor], context=contextlib.nullcontext) -> list[float]:
    optimizer = _optimizer(model.parameters())
    losses = []
    for tokens in batches:
        with context():
            loss = next_token_loss(runner(tokens), tokens)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor as it is)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _full(parameter: torch.Tensor) -> torch.Tensor:
    return (parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter).detach().float()


def _sharded(mode: str, reference: nn.Module, bf16: bool) -> tuple[nn.Module, Callable, Callable]:
    """(model, what to call, context of each step) for one way of running our FSDP."""
    torch._dynamo.reset()
    policy = fsdp_compile.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    model = shard_model(copy.deepcopy(reference), fsdp_compile.fully_shard, **({"mp_policy": policy} if policy else {}))
    if mode == "eager":
        return model, model, contextlib.nullcontext
    if mode == "frames":  # the default: each block a frame of its own
        return model, torch.compile(model, backend="fsdp_inductor"), contextlib.nullcontext
    if mode == "regions":  # the whole model one graph, a nested region per block
        return model, torch.compile(model, backend="fsdp_inductor"), lambda: block_compile_mode("regions")
    if mode == "blockcompile":  # torchtitan's recipe on ours
        for block in model.layers:
            block.compile(backend="fsdp_inductor")
        return model, model, contextlib.nullcontext
    raise ValueError(mode)


# (loss rtol, parameter atol) against the unsharded model. Eager runs the reference's kernels on
# copies of its weights; compiled code fuses and reorders float math (in bf16: rounds fused
# intermediates less often than eager, so it lands within bf16 rounding of it, as on CPU in
# test_compile.py).
TOLERANCES = {
    ("eager", False): (1e-5, 1e-5), ("eager", True): (1e-4, 1e-4),
    ("compiled", False): (1e-4, 1e-4), ("compiled", True): (1e-2, 2e-3),
}


def _check_against_unsharded(cuda: torch.device, mode: str, bf16: bool) -> None:
    """Train the unsharded model and ours (``mode``) from the same weights on the same batches;
    the losses and the final parameters agree within TOLERANCES, and training moved the
    parameters by far more than that (so the comparison could fail)."""
    torch.manual_seed(0)
    reference = Transformer(CONFIG).to(cuda)
    batches = _batches(cuda)
    initial = copy.deepcopy(reference)
    model, runner, context = _sharded(mode, reference, bf16)
    reference_losses = _train_unsharded(reference, batches, bf16)
    losses = _train(model, runner, batches, context)
    loss_rtol, param_atol = TOLERANCES[("eager" if mode == "eager" else "compiled", bf16)]
    for step, (ours, theirs) in enumerate(zip(losses, reference_losses)):
        assert abs(ours - theirs) <= loss_rtol * abs(theirs), (
            f"step {step}: loss {ours} vs unsharded {theirs} (all: {losses} vs {reference_losses})"
        )
    reference_params = dict(reference.named_parameters())
    gap = max((_full(p) - reference_params[name].float()).abs().max().item() for name, p in model.named_parameters())
    moved = max((a.float() - b.float()).abs().max().item() for a, b in zip(initial.parameters(), reference.parameters()))
    assert gap <= param_atol, f"parameters differ from the unsharded model's by {gap} (training moved them by {moved})"
    assert moved >= 10 * param_atol, f"training moved the parameters by only {moved}: the comparison proves nothing"
    assert all(_local(p).device.type == cuda.type for p in model.parameters())


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_eager_training_matches_the_unsharded_model(cuda, bf16):
    _check_against_unsharded(cuda, "eager", bf16)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_eager_matches_torch_fully_shard(cuda, bf16):
    """Same shards, casts and update as PyTorch's FSDP2 on the same GPU (bitwise on CPU; here within
    what a different kernel choice for a differently aligned buffer could change)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    reference = Transformer(CONFIG).to(cuda)
    batches = _batches(cuda)
    param_dtype = torch.bfloat16 if bf16 else None
    ours = shard_model(copy.deepcopy(reference), fsdp_compile.fully_shard,
                       mp_policy=fsdp_compile.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32))
    theirs = shard_model(copy.deepcopy(reference), torch_fully_shard, mp_policy=TorchPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32))
    our_losses, their_losses = _train(ours, ours, batches), _train(theirs, theirs, batches)
    for step, (a, b) in enumerate(zip(our_losses, their_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: ours {our_losses} vs FSDP2 {their_losses}"
    gap = max((_full(a) - _full(b)).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))
    assert gap <= 1e-5, f"parameters differ from FSDP2's by {gap}"


# ---- the stream protocol on real streams -----------------------------------------------------------


class LoggingHandle(DeviceHandle):
    """The real CUDA handle, logging every operation as test_stream_protocol.py's RecordingHandle
    does (``("run", stream, phase)``, ``("record", stream, event)``, ...), streams by the name they
    were made for ("compute" for any other) and events as ``purpose#n``."""

    def __init__(self, device: torch.device, log: list[tuple[str, ...]]) -> None:
        super().__init__(device)
        self.log = log
        self.counter = itertools.count()
        self.stream_names: dict[int, str] = {}
        self.events: list[tuple[torch.cuda.Event, str]] = []  # kept alive, so no id() is reused

    def name(self, stream: torch.cuda.Stream) -> str:
        return self.stream_names.get(stream.cuda_stream, "compute")

    def new_stream(self, name: str):
        stream = super().new_stream(name)
        self.stream_names[stream.cuda_stream] = name
        return stream

    @contextlib.contextmanager
    def on_stream(self, stream, phase: str):
        self.log.append(("run", self.name(stream if stream is not None else self.current_stream()), phase))
        with super().on_stream(stream, phase):
            yield

    def wait_stream(self, waiter, waited) -> None:
        if self.name(waiter) != self.name(waited):
            self.log.append(("wait_stream", self.name(waiter), self.name(waited)))
        super().wait_stream(waiter, waited)

    def record_event(self, stream, purpose: str):
        event = super().record_event(stream, purpose)
        name = f"{purpose}#{next(self.counter)}"
        self.events.append((event, name))
        self.log.append(("record", self.name(stream), name))
        return event

    def wait_event(self, stream, event) -> None:
        if event is not None:
            self.log.append(("wait_event", self.name(stream), next((n for e, n in self.events if e is event), "other")))
        super().wait_event(stream, event)


def test_stream_protocol_orders_copy_in_all_gather_and_compute_on_real_streams(cuda, monkeypatch):
    """test_stream_protocol.py's orderings (there on a recording stand-in at world size 2), here on
    the CUDA streams and events the runtime really makes.

    At world size 1 the runtime copies shards and writes gradients without the flat buffers, and so
    without the side streams ([Note: an unshard over a shard group of one rank], [Note: a reduction
    over a shard group of one rank]); both shortcuts are turned off here, so one GPU runs the
    streams and events of a larger world (the third H200 run found no reduce-scatter stream)."""
    log: list[tuple[str, ...]] = []
    handles: list[LoggingHandle] = []

    def make(device):
        handles.append(LoggingHandle(device, log))
        return handles[-1]

    monkeypatch.setattr(comm_context, "make_device_handle", make)
    monkeypatch.setattr(FSDPParamGroup, "_copies_at_one_rank", lambda group: False)
    monkeypatch.setattr(FSDPParamGroup, "_reduces_on_one_rank", lambda group: False)
    model = shard_model(build_reference().to(cuda), fsdp_compile.fully_shard)
    per_step = []
    for batch in global_batches(2, 2, 1):
        tokens = batch.to(cuda)
        start = len(log)
        next_token_loss(model(tokens), tokens).backward()
        per_step.append(log[start:])
    torch.cuda.synchronize()
    assert handles and all(h.uses_streams for h in handles), "the runtime made no CUDA handle"
    assert {"all_gather_copy_in", "all_gather", "reduce_scatter"} <= set().union(*(h.stream_names.values() for h in handles))
    step = per_step[1]
    layers = len(model.layers)
    all_gathers = [e for kind, stream, e in step if kind == "record" and stream == "all_gather" and e.startswith("all_gather#")]
    assert len(all_gathers) == 2 * layers + 1, "forward: root + every block; backward: every block again"
    for event in all_gathers:
        issued = step.index(("record", "all_gather", event))
        assert step[issued - 2] == ("wait_stream", "all_gather", "all_gather_copy_in")
        assert step[issued - 1] == ("run", "all_gather", "all_gather")
        waited = step.index(("wait_event", "compute", event))
        assert issued < waited, f"compute waits on {event} before it is recorded"
    gradients = [e for kind, stream, e in step if kind == "record" and stream == "compute" and e.startswith("gradients")]
    assert len(gradients) == layers + 1
    for event in gradients:
        at = step.index(("record", "compute", event))
        assert step[at + 1 : at + 3] == [("wait_event", "reduce_scatter", event), ("run", "reduce_scatter", "reduce_scatter_copy_in")]


# ---- CPU offload -----------------------------------------------------------------------------------


def test_cpu_offload_keeps_pinned_shards_and_gradients_on_the_host_and_trains_like_no_offload(cuda):
    torch.manual_seed(0)
    reference = Transformer(CONFIG).to(cuda)
    batches = _batches(cuda)
    plain = shard_model(copy.deepcopy(reference), fsdp_compile.fully_shard)
    offloaded = shard_model(copy.deepcopy(reference), fsdp_compile.fully_shard, offload_policy=fsdp_compile.CPUOffloadPolicy())
    assert all(_local(p).device.type == "cpu" and _local(p).is_pinned() for p in offloaded.parameters())
    tokens = batches[0]
    next_token_loss(offloaded(tokens), tokens).backward()
    assert all(p.grad is not None and _local(p.grad).device.type == "cpu" for p in offloaded.parameters())
    offloaded.zero_grad(set_to_none=True)
    plain_losses, losses = _train(plain, plain, batches), _train(offloaded, offloaded, batches)
    # SGD steps on the CPU for the offloaded model: its float arithmetic may round unlike the GPU's.
    for step, (a, b) in enumerate(zip(losses, plain_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: offloaded {losses} vs not {plain_losses}"
    # At world size 1 a shard is the whole parameter (no all-gather of a host tensor over NCCL needed).
    gap = max((_local(a).cpu() - _local(b).cpu()).abs().max().item() for a, b in zip(offloaded.parameters(), plain.parameters()))
    assert gap <= 1e-5, f"parameters differ by {gap}"
    assert all(_local(p).device.type == "cpu" and _local(p).is_pinned() for p in offloaded.parameters()), "after the steps too"


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_compiled_cpu_offload_keeps_shards_and_gradients_on_the_host_and_trains_like_eager_offload(cuda, bf16):
    """The whole model compiled (fsdp_inductor, blocks as frames) with ``CPUOffloadPolicy()``: the traced
    reads copy the pinned host shards to the GPU and the gradients come back to host memory ([Note:
    offloaded shards under whole-model compile] in compile/param_reads.py); it trains as the eager
    runtime with the same offload. (World size 1: no all-gather, so no frame op; the copies are the graph's.)"""
    torch.manual_seed(0)
    reference = Transformer(CONFIG).to(cuda)
    batches = _batches(cuda)
    kwargs: dict = {"offload_policy": fsdp_compile.CPUOffloadPolicy()}
    if bf16:
        kwargs["mp_policy"] = fsdp_compile.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    eager = shard_model(copy.deepcopy(reference), fsdp_compile.fully_shard, **kwargs)
    torch._dynamo.reset()
    offloaded = shard_model(copy.deepcopy(reference), fsdp_compile.fully_shard, **kwargs)
    runner = torch.compile(offloaded, backend="fsdp_inductor")
    tokens = batches[0]
    next_token_loss(runner(tokens), tokens).backward()
    assert all(p.grad is not None and _local(p.grad).device.type == "cpu" for p in offloaded.parameters())
    offloaded.zero_grad(set_to_none=True)
    eager_losses, losses = _train(eager, eager, batches), _train(offloaded, runner, batches)
    loss_rtol, param_atol = TOLERANCES[("compiled", bf16)]
    for step, (a, b) in enumerate(zip(losses, eager_losses)):
        assert abs(a - b) <= loss_rtol * abs(b), f"step {step}: compiled {losses} vs eager {eager_losses}"
    gap = max((_local(a) - _local(b)).abs().max().item() for a, b in zip(offloaded.parameters(), eager.parameters()))
    moved = max((_local(a).cpu() - b.detach().cpu()).abs().max().item() for a, b in zip(eager.parameters(), reference.parameters()))
    assert gap <= param_atol < moved / 10, f"parameters differ from eager offload's by {gap} (training moved them by {moved})"
    assert all(_local(p).device.type == "cpu" and _local(p).is_pinned() for p in offloaded.parameters()), "after the steps too"


def test_offloading_a_model_built_on_the_gpu_frees_its_device_memory(cuda):
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model = Transformer(CONFIG).to(cuda)
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    shard_model(model, fsdp_compile.fully_shard, offload_policy=fsdp_compile.CPUOffloadPolicy())
    torch.cuda.synchronize()
    # What stays: the rotary tables (buffers) and the runtime's small state, not the parameters.
    assert torch.cuda.memory_allocated() - before < parameter_bytes / 4, "the parameters (or a copy) stayed on the GPU"


# ---- the Triton kernels on CUDA against their references -----------------------------------------


@pytest.fixture(scope="module")
def compiled_triton():
    """fsdp_compile.kernels.triton_impl compiled for the GPU (not the interpreter)."""
    pytest.importorskip("triton")
    from fsdp_compile.kernels import triton_impl

    if triton_impl.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set: the kernels are interpreted, not compiled for the GPU")
    return triton_impl


def _kernel_helpers():
    import test_kernels

    return test_kernels


def _values(numel: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return _kernel_helpers().interesting_values(numel, dtype, gen).to(device)


def _poisoned(shape, dtype, device: torch.device) -> torch.Tensor:
    return _kernel_helpers().poisoned(shape, dtype).to(device)


def _same_bits(actual: torch.Tensor, expected: torch.Tensor, nan_payloads: bool = True) -> None:
    _kernel_helpers().assert_same_bits(actual.cpu(), expected.cpu(), nan_payloads)


def _kernel_cases() -> list:
    """test_kernels.py's cases: every dtype pair on 1-parameter groups at world sizes 1-8, and
    100-parameter groups (empty, 1-element and multi-block parameters) on the narrowing pairs."""
    import test_kernels

    return test_kernels.kernel_cases(100)


def _scaled_kernel_cases(one: list[tuple], hundred: dict[str, tuple]) -> list:
    import test_kernels

    return test_kernels.with_scalings(_kernel_cases(), one, hundred)


# The same NaN rule as test_kernels.py: NaN payloads are compared only where no cast or divide
# rewrites them (a converted NaN has no one right payload).
@pytest.mark.parametrize("src, dst, count, worlds", _kernel_cases())
def test_triton_all_gather_copy_in_equals_reference_on_cuda(cuda, compiled_triton, src, dst, count, worlds):
    from fsdp_compile.kernels import reference
    from test_kernels import make_group, shard

    for world in worlds:
        gen = torch.Generator().manual_seed(world)
        shapes, padded = make_group(count, world, seed=world)
        for rank in sorted({0, world - 1}):
            shards = [shard(_values(math.prod(s), src, gen, cuda).view(s), rank, world) for s in shapes]
            ours, theirs = _poisoned((sum(padded),), dst, cuda), _poisoned((sum(padded),), dst, cuda)
            compiled_triton.all_gather_copy_in(shards, padded, ours)
            reference.all_gather_copy_in(shards, padded, theirs)
            _same_bits(ours, theirs, nan_payloads=src == dst)


@pytest.mark.parametrize("src, dst, count, worlds", _kernel_cases())
def test_triton_all_gather_copy_out_equals_reference_on_cuda(cuda, compiled_triton, src, dst, count, worlds):
    from fsdp_compile.kernels import reference
    from test_kernels import make_group

    for world in worlds:
        gen = torch.Generator().manual_seed(world)
        shapes, padded = make_group(count, world, seed=world + 1)
        gathered = _values(world * sum(padded), src, gen, cuda).view(world, sum(padded))
        ours, theirs = [_poisoned(s, dst, cuda) for s in shapes], [_poisoned(s, dst, cuda) for s in shapes]
        compiled_triton.all_gather_copy_out(gathered, padded, ours)
        reference.all_gather_copy_out(gathered, padded, theirs)
        for a, b in zip(ours, theirs):
            _same_bits(a, b, nan_payloads=src == dst)


@pytest.mark.parametrize(
    "src, dst, count, worlds, pre_divide",
    _scaled_kernel_cases([(1.0,), (3.0,)], {"100params-fp32-bf16": (1.0,), "100params-fp32-fp16": (3.0,)}),
)
def test_triton_reduce_scatter_copy_in_equals_reference_on_cuda(cuda, compiled_triton, src, dst, count, worlds, pre_divide):
    from fsdp_compile.kernels import reference
    from test_kernels import make_group

    for world in worlds:
        gen = torch.Generator().manual_seed(world)
        shapes, padded = make_group(count, world, seed=world + 2)
        grads = [_values(math.prod(s), src, gen, cuda).view(s) for s in shapes]
        ours, theirs = _poisoned((world, sum(padded)), dst, cuda), _poisoned((world, sum(padded)), dst, cuda)
        compiled_triton.reduce_scatter_copy_in(grads, padded, ours, pre_divide)
        reference.reduce_scatter_copy_in(grads, padded, theirs, pre_divide)
        _same_bits(ours, theirs, nan_payloads=src == dst and pre_divide == 1.0)


@pytest.mark.parametrize(
    "src, dst, count, worlds, post_divide, accumulate",
    _scaled_kernel_cases(
        [(1.0, False), (1.0, True), (3.0, False), (3.0, True)],
        {"100params-fp32-bf16": (1.0, True), "100params-fp32-fp16": (3.0, False)},
    ),
)
def test_triton_reduce_scatter_copy_out_equals_reference_on_cuda(cuda, compiled_triton, src, dst, count, worlds, post_divide, accumulate):
    from fsdp_compile.kernels import reference
    from test_kernels import make_group, shard

    for world in worlds:
        gen = torch.Generator().manual_seed(world)
        shapes, padded = make_group(count, world, seed=world + 3)
        rank = world - 1
        reduced = _values(sum(padded), src, gen, cuda)
        sharded_shapes = [shard(torch.empty(s), rank, world).shape for s in shapes]
        if accumulate:
            ours = [torch.randn(s, generator=gen).to(dst).to(cuda) for s in sharded_shapes]
        else:
            ours = [_poisoned(s, dst, cuda) for s in sharded_shapes]
        theirs = [t.clone() for t in ours]
        compiled_triton.reduce_scatter_copy_out(reduced, padded, ours, post_divide, accumulate)
        reference.reduce_scatter_copy_out(reduced, padded, theirs, post_divide, accumulate)
        exact_nans = src == dst and post_divide == 1.0 and not accumulate
        for a, b in zip(ours, theirs):
            _same_bits(a, b, nan_payloads=exact_nans)


# Rows per rank of each parameter of the large group (1024 columns, 3 rows short of even over 8 ranks).
LARGE_GROUP_ROWS = (300, 750, 2600, 36, 1900, 9, 300, 1100, 375, 150)


def test_triton_kernels_equal_reference_on_a_large_group_and_serve_the_custom_ops(cuda, compiled_triton):
    """A group of about 250 MB in fp32 (to bf16 and back, 8 ranks, 10 uneven parameters): grids of
    tens of thousands of programs; and the custom op dispatches CUDA tensors to these kernels."""
    from fsdp_compile.kernels import reference
    from test_kernels import shard

    world = 8
    shapes = [(rows * world + 3, 1024) for rows in LARGE_GROUP_ROWS]
    padded = [_kernel_helpers().padded_numel(s, world) for s in shapes]
    gen = torch.Generator(device=cuda).manual_seed(0)
    unsharded = [torch.randn(s, device=cuda, generator=gen) for s in shapes]
    shards = [shard(t, world - 1, world) for t in unsharded]
    rows = {name: torch.empty(sum(padded), dtype=torch.bfloat16, device=cuda) for name in ("triton", "op", "reference")}
    compiled_triton.all_gather_copy_in(shards, padded, rows["triton"])
    torch.ops.fsdp_compile.all_gather_copy_in(shards, padded, rows["op"])
    reference.all_gather_copy_in(shards, padded, rows["reference"])
    _same_bits(rows["triton"], rows["reference"])
    _same_bits(rows["op"], rows["reference"])
    gathered = rows["reference"].repeat(world, 1)
    outs = [[torch.empty(s, dtype=torch.bfloat16, device=cuda) for s in shapes] for _ in range(2)]
    compiled_triton.all_gather_copy_out(gathered, padded, outs[0])
    reference.all_gather_copy_out(gathered, padded, outs[1])
    for a, b in zip(*outs):
        _same_bits(a, b)
    grads = [t.to(torch.bfloat16) for t in unsharded]
    buffers = [torch.empty(world, sum(padded), device=cuda) for _ in range(2)]
    compiled_triton.reduce_scatter_copy_in(grads, padded, buffers[0], float(world))
    reference.reduce_scatter_copy_in(grads, padded, buffers[1], float(world))
    _same_bits(buffers[0], buffers[1])
    sharded = [[torch.zeros_like(s) for s in shards] for _ in range(2)]
    compiled_triton.reduce_scatter_copy_out(buffers[0][world - 1], padded, sharded[0], 1.0, True)
    reference.reduce_scatter_copy_out(buffers[1][world - 1], padded, sharded[1], 1.0, True)
    for a, b in zip(*sharded):
        _same_bits(a, b)


def test_triton_launch_metadata_is_copied_once_per_group_and_read_from_any_stream(cuda, compiled_triton):
    """[Note: launch metadata kept on the device]: the second call with the same tensors reuses the
    first call's metadata, new values in those tensors are still copied, and a launch on another
    stream right after the first reads complete metadata."""
    from fsdp_compile.kernels import reference
    from test_kernels import make_group, shard

    world = 2
    shapes, padded = make_group(3, world, seed=0)
    shards = [shard(torch.randn(s, device=cuda), 0, world) for s in shapes]
    row, expected = torch.empty(sum(padded), device=cuda), torch.empty(sum(padded), device=cuda)
    cache = compiled_triton._metadata_on_device
    cache.cache_clear()
    side = torch.cuda.Stream()
    compiled_triton.all_gather_copy_in(shards, padded, row)
    with torch.cuda.stream(side):  # no wait on the default stream: the metadata must already be there
        side_row = torch.empty(sum(padded), device=cuda)
        compiled_triton.all_gather_copy_in(shards, padded, side_row)
    side.synchronize()
    for shard in shards:
        shard.mul_(-2.0)
    compiled_triton.all_gather_copy_in(shards, padded, row)
    info = cache.cache_info()
    # One copy for all three: the metadata holds the shards' addresses (the output is an argument).
    assert (info.misses, info.hits) == (1, 2), info
    reference.all_gather_copy_in(shards, padded, expected)
    _same_bits(row, expected)
    assert torch.equal(side_row, expected / -2.0)  # the values before the sign flip (+0 and -0 padding alike)


# The quantized kernels (test_quant_kernels.py's cases), here compiled for the GPU.


@pytest.fixture(scope="module")
def compiled_quantized_triton(compiled_triton):
    from fsdp_compile.kernels import quantized_triton

    if quantized_triton.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set")
    return quantized_triton


@pytest.mark.parametrize("buffer_dtype", [torch.int8, torch.float8_e4m3fn, torch.uint8], ids=["int8", "e4m3", "e4m3-bytes"])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("block", [128, 48])
def test_triton_quantized_copy_in_equals_reference_on_cuda(cuda, compiled_quantized_triton, block, src, buffer_dtype):
    from fsdp_compile.kernels import quantized_reference
    from fsdp_compile.runtime.layout import ShardLayout
    from test_quant_kernels import SENTINEL, group

    world, rank = 2, 0
    shapes, padded = group(world, seed=block)
    gen = torch.Generator().manual_seed(block)
    shards = [
        ShardLayout(shape, 0, world, rank).shard_of(torch.randn(shape, generator=gen) * 3).contiguous().to(src).to(cuda)
        for shape in shapes
    ]
    shards[2].view(-1)[:2] = torch.tensor([0.0, -0.0])
    shards[3].view(-1)[:block] = 0.0
    total = sum(quantized_reference.quantized_slot_numels(padded, block))
    data = [torch.full((total,), 99, dtype=torch.int8, device=cuda) for _ in range(2)]
    scales = [torch.full((total // block,), SENTINEL, device=cuda) for _ in range(2)]
    compiled_quantized_triton.quantized_all_gather_copy_in(shards, padded, data[0].view(buffer_dtype), scales[0], block)
    quantized_reference.quantized_all_gather_copy_in(shards, padded, data[1].view(buffer_dtype), scales[1], block)
    _same_bits(scales[0], scales[1])
    assert torch.equal(data[0], data[1]), f"{(data[0] != data[1]).sum().item()} of {total} codes differ"


@pytest.mark.parametrize("buffer_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "e4m3"])
@pytest.mark.parametrize("dst", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_triton_quantized_copy_out_equals_reference_on_cuda(cuda, compiled_quantized_triton, dst, buffer_dtype):
    from fsdp_compile.kernels import quantized_reference
    from test_quant_kernels import SENTINEL, group

    world, block = 3, 64
    shapes, padded = group(world, seed=1)
    gen = torch.Generator().manual_seed(6)
    total = sum(quantized_reference.quantized_slot_numels(padded, block))
    codes = torch.randint(-128, 128, (world, total), dtype=torch.int8, generator=gen)
    codes = codes.clamp(-127, 127) if buffer_dtype == torch.int8 else torch.where((codes & 0x7F) == 0x7F, 0, codes)
    scales = (10.0 ** torch.empty(world, total // block).uniform_(-3, 3, generator=gen)).to(cuda)
    codes = codes.to(cuda)
    outs = [[torch.full(s, SENTINEL, dtype=dst, device=cuda) for s in shapes] for _ in range(2)]
    compiled_quantized_triton.quantized_all_gather_copy_out(codes.view(buffer_dtype), scales, padded, outs[0], block)
    quantized_reference.quantized_all_gather_copy_out(codes.view(buffer_dtype), scales, padded, outs[1], block)
    for a, b in zip(*outs):
        _same_bits(a, b)


@pytest.mark.parametrize("own_rank", [None, 2], ids=["all-received", "own-row-2"])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("post_divide", [1.0, 3.0])
@pytest.mark.parametrize("src, dst", [(torch.bfloat16, torch.float32), (torch.float32, torch.float16)], ids=["bf16-fp32", "fp32-fp16"])
def test_triton_sum_rows_copy_out_equals_reference_on_cuda(cuda, compiled_quantized_triton, src, dst, post_divide, accumulate, own_rank):
    from fsdp_compile.kernels import quantized_reference
    from fsdp_compile.runtime.layout import ShardLayout
    from test_quant_kernels import SENTINEL, group

    world = 4
    shapes, padded = group(world, seed=2)
    gen = torch.Generator().manual_seed(7)
    received = torch.randn(world, sum(padded), generator=gen).to(src).to(cuda)
    own = {} if own_rank is None else {"own_row": torch.randn(sum(padded), generator=gen).to(cuda), "own_rank": own_rank}
    sharded = [ShardLayout(shape, 0, world, world - 1).shard_of(torch.empty(shape)).shape for shape in shapes]
    if accumulate:
        ours = [torch.randn(s, generator=gen).to(dst).to(cuda) for s in sharded]
    else:
        ours = [torch.full(s, SENTINEL, dtype=dst, device=cuda) for s in sharded]
    theirs = [t.clone() for t in ours]
    compiled_quantized_triton.sum_rows_copy_out(received, padded, ours, post_divide, accumulate, **own)
    quantized_reference.sum_rows_copy_out(received, padded, theirs, post_divide, accumulate, **own)
    for a, b in zip(ours, theirs):
        _same_bits(a, b)


# ---- compiled training against the unsharded model (last of the in-process tests: each compiles) ----


@pytest.mark.parametrize("mode", ["frames", "regions", "blockcompile"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_compiled_training_matches_the_unsharded_model(cuda, mode, bf16):
    """frames: torch.compile(model, backend="fsdp_inductor"), each block a frame (the default);
    regions: the same with config.block_compile = "regions", one graph with a region per block;
    blockcompile: block.compile(backend="fsdp_inductor") per block after fully_shard."""
    _check_against_unsharded(cuda, mode, bf16)


# ---- the CUDA sanitizer ---------------------------------------------------------------------------


_SANITIZED_TRAINING = """
import sys
import torch
import torch.cuda._sanitizer
import torch.distributed as dist

sys.path[:0] = [sys.argv[2], sys.argv[3]]
import fsdp_compile
from fsdp_compile.models import next_token_loss
from fsdp_testing import build_reference, global_batches, shard_model

torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method=sys.argv[1], rank=0, world_size=1)
# From here on every kernel's reads and writes are checked against the streams' synchronization.
torch.cuda._sanitizer.enable_cuda_sanitizer()
policy = fsdp_compile.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
model = shard_model(build_reference().cuda(), fsdp_compile.fully_shard, mp_policy=policy)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for batch in global_batches(3, 2, 1):
    tokens = batch.cuda()
    next_token_loss(model(tokens), tokens).backward()
    optimizer.step()
    optimizer.zero_grad()
torch.cuda.synchronize()
dist.destroy_process_group()
print("sanitized steps: no unsynchronized access")
"""


def test_training_steps_pass_the_cuda_sanitizer(cuda):
    """CSAN (torch.cuda._sanitizer) in a process of its own, as it cannot be turned off once on:
    forward, backward and AdamW steps in bf16 mixed precision, with every all-gather copy-in on its
    side stream, each copy-out and reduce-scatter copy-in ordered by events."""
    result = subprocess.run(
        [sys.executable, "-c", _SANITIZED_TRAINING, f"tcp://127.0.0.1:{free_port()}", TESTS_DIR, REPO_DIR],
        cwd=REPO_DIR, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, f"CSAN run failed:\n{result.stdout[-2000:]}\n{result.stderr[-6000:]}"
    assert "no unsynchronized access" in result.stdout
