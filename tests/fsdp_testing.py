"""Shared pieces of the distributed tests: the test model, data, reference training, comparisons.

Everything here runs inside the gloo worker processes of conftest.py.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_compile.models import Transformer, TransformerConfig, next_token_loss

SMALL = TransformerConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, max_seq_len=16)
# Uneven on purpose: 37 rows do not split evenly over 2, 3 or 4 ranks.
UNEVEN = TransformerConfig(vocab_size=37, dim=24, n_layers=2, n_heads=2, ffn_hidden=40, max_seq_len=16)


class TinyLM(nn.Module):
    """UNEVEN's vocabulary (37 rows: padded shards) with the least to trace: an embedding, linear
    blocks, a head. For tests about collectives and settings, where a transformer block's many ops
    only add Dynamo and AOTAutograd time (each compile of it costs seconds on 2 cores)."""

    def __init__(self, vocab_size: int = UNEVEN.vocab_size, dim: int = 8, n_layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_layers))
        self.output = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x).relu()
        return self.output(x)


class BlocksNet(nn.Module):
    """Linear blocks between an input layer and a head (one group outside the blocks when the root is
    sharded, one per block), every block's weight needed in backward (its input carries a gradient),
    as in a transformer: the compiled-settings tests' model."""

    def __init__(self, n_blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(n_blocks))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x).relu()
        return self.head(x)


class CountingAllGather:
    """An FSDP2 ``AllGather`` doing what the default does (torch.empty, torch.distributed), counting calls."""

    def __init__(self) -> None:
        self.allocated: list[tuple[int, ...]] = []
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        self.allocated.append(tuple(size))
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output, input, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)


class CountingReduceScatter(CountingAllGather):
    """An FSDP2 ``ReduceScatter``."""

    def __call__(self, output, input, group, op, async_op=False):
        self.calls += 1
        return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


def build_reference(config: TransformerConfig = SMALL, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(config)


def global_batches(steps: int, batch_per_rank: int, world_size: int, config: TransformerConfig = SMALL, seq: int = 12, seed: int = 1) -> list[torch.Tensor]:
    """Learnable sequences (random start, small random stride, modulo vocab), so loss falls."""
    generator = torch.Generator().manual_seed(seed)
    rows = batch_per_rank * world_size
    batches = []
    for _ in range(steps):
        start = torch.randint(0, config.vocab_size, (rows, 1), generator=generator)
        stride = torch.randint(1, 4, (rows, 1), generator=generator)
        batches.append((start + stride * torch.arange(seq)) % config.vocab_size)
    return batches


def local_part(batch: torch.Tensor, rank: int | None = None, world_size: int | None = None) -> torch.Tensor:
    rank = dist.get_rank() if rank is None else rank
    world_size = dist.get_world_size() if world_size is None else world_size
    return batch.chunk(world_size)[rank]


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    raise ValueError(kind)


def train_reference(model: nn.Module, batches: list[torch.Tensor], optimizer: str, micro_batches: int = 1) -> list[float]:
    """Single-process unsharded training on the global batches: the ground truth."""
    opt = make_optimizer(optimizer, model.parameters())
    losses = []
    for batch in batches:
        total = 0.0
        for micro in batch.chunk(micro_batches):
            loss = next_token_loss(model(micro), micro) / micro_batches
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def mean_across_ranks(value: float, group=None) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, group=group)
    return tensor.item() / dist.get_world_size(group)


def train_sharded(
    model: nn.Module,
    batches: list[torch.Tensor],
    optimizer: str,
    micro_batches: int = 1,
    data_rank: int | None = None,
    data_world: int | None = None,
    before_step: Callable[[int], None] | None = None,
) -> list[float]:
    """Each rank trains on its slice of every global batch; returns the global mean loss per step."""
    opt = make_optimizer(optimizer, model.parameters())
    losses = []
    for step, batch in enumerate(batches):
        if before_step is not None:
            before_step(step)
        local = local_part(batch, data_rank, data_world)
        total = 0.0
        micro_list = local.chunk(micro_batches)
        for index, micro in enumerate(micro_list):
            last = index == len(micro_list) - 1
            if micro_batches > 1:
                model.set_requires_gradient_sync(last)
            loss = next_token_loss(model(micro), micro) / micro_batches
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(mean_across_ranks(total))
    return losses


def max_difference(sharded: list[torch.Tensor | None], reference: list[torch.Tensor | None]) -> float:
    """Largest elementwise gap; a missing gradient on either side is an infinite gap."""
    worst = 0.0
    for mine, theirs in zip(sharded, reference, strict=True):
        if mine is None or theirs is None:
            if mine is not theirs:
                return float("inf")
            continue
        worst = max(worst, (mine.float() - theirs.float()).abs().max().item())
    return worst


def max_param_difference(sharded: nn.Module, reference: nn.Module) -> float:
    """Largest |sharded - reference| over all parameters (gathers each DTensor: collective)."""
    worst = 0.0
    reference_params = dict(reference.named_parameters())
    names = [name for name, _ in sharded.named_parameters()]
    assert names == list(reference_params), f"parameter names differ: {names} vs {list(reference_params)}"
    for name, param in sharded.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        assert full.shape == reference_params[name].shape, name
        worst = max(worst, (full.detach() - reference_params[name].detach()).abs().max().item())
    return worst


def shard_model(model: Transformer, fully_shard, **kwargs) -> Transformer:
    layer_kwargs = dict(kwargs)
    for layer in model.layers:
        fully_shard(layer, **layer_kwargs)
    root_kwargs = {k: v for k, v in kwargs.items() if k != "reshard_after_forward"}
    fully_shard(model, **root_kwargs)
    return model


def sharded_copy(reference: nn.Module) -> nn.Module:
    return copy.deepcopy(reference)


_PROCESS_GROUP_CALLS = (
    "all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base", "all_gather_object",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_reduce", "all_to_all_single",
    "broadcast", "broadcast_object_list", "barrier", "new_group", "new_subgroups_by_enumeration",
)


@contextlib.contextmanager
def count_process_group_calls():
    """Names of the torch.distributed collectives (and group creations) called inside the block.

    Patches the functions where our code and torch's look them up (``torch.distributed``, its
    ``distributed_c10d`` module and ``fsdp_compile.runtime.collectives``' aliases), so an error can be shown
    to come before anything another rank would have to match.
    """
    import torch.distributed.distributed_c10d as c10d

    import fsdp_compile.runtime.collectives as ours

    calls: list[str] = []
    patched: list[tuple[object, str, object]] = []

    def counting(name: str, original):
        def call(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)

        return call

    for owner in (dist, c10d, ours):
        for attribute, value in list(vars(owner).items()):
            target = getattr(value, "__name__", None)
            if callable(value) and (attribute in _PROCESS_GROUP_CALLS or target in _PROCESS_GROUP_CALLS):
                patched.append((owner, attribute, value))
                setattr(owner, attribute, counting(attribute, value))
    try:
        yield calls
    finally:
        for owner, attribute, value in patched:
            setattr(owner, attribute, value)


class Parity(NamedTuple):
    """A worker's comparison of sharded training with an unsharded reference (workers with more to
    report return a NamedTuple that starts with these fields)."""

    losses: list[float]  # global loss per step, sharded
    reference_losses: list[float]  # the unsharded model's
    max_param_gap: float  # between the sharded and the reference parameters after training
    movement: float  # how far training moved the reference parameters


def parameter_movement(before: nn.Module, after: nn.Module) -> float:
    """The largest change of any parameter between two copies of a model."""
    return max((a - b).abs().max().item() for a, b in zip(before.parameters(), after.parameters()))


def assert_matches_reference(results: list, loss_rtol: float, param_atol: float) -> None:
    """``results``: per rank, a ``Parity`` or a result that starts with its fields. The ranks agree
    on the loss, which follows the reference's, the parameters end within ``param_atol`` of it, and
    training moved them by far more than that (so the comparison could fail)."""
    first = results[0]
    for rank_result in results:
        assert rank_result.losses == first.losses, "ranks disagree on the global loss"
    for step, (ours, ref) in enumerate(zip(first.losses, first.reference_losses)):
        assert abs(ours - ref) <= loss_rtol * abs(ref), f"step {step}: loss {ours} vs reference {ref}"
    assert first.max_param_gap <= param_atol, f"parameters differ from the reference by {first.max_param_gap}"
    assert first.movement > 100 * param_atol, f"parameters moved only {first.movement}: the comparison proves nothing"


@contextlib.contextmanager
def block_compile_mode(
    mode: str = "frames", recompile_limit: int | None = None, passes: Any = None, graphs_outside_blocks: str | None = None,
):
    """``fsdp_compile.config.block_compile`` set to ``mode`` ("frames", the default: a Dynamo frame per
    block; "regions": the whole model one graph with a nested compile region per block; "inline"),
    Dynamo's ``recompile_limit``, ``fsdp_compile.config.passes`` (a ``PassConfig``) and
    ``fsdp_compile.config.graphs_outside_blocks`` where given, for the duration."""
    import fsdp_compile

    config = fsdp_compile.config
    previous = config.block_compile, torch._dynamo.config.recompile_limit, config.passes, config.graphs_outside_blocks
    config.block_compile = mode
    if recompile_limit is not None:
        torch._dynamo.config.recompile_limit = recompile_limit
    if passes is not None:
        config.passes = passes
    if graphs_outside_blocks is not None:
        config.graphs_outside_blocks = graphs_outside_blocks
    try:
        yield
    finally:
        config.block_compile, torch._dynamo.config.recompile_limit, config.passes, config.graphs_outside_blocks = previous


def wait_for_background_run(started: tuple, what: str, timeout_s: float = 600) -> tuple[str, object]:
    """Wait for a run the suite started in the background at collection (``(process, out_dir,
    scratch)``, see conftest's ``_BACKGROUND_RUNS``): its stdout and out dir, or a failure quoting it."""
    import subprocess

    process, out_dir, scratch = started
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    stdout, stderr = (scratch / "stdout").read_text(), (scratch / "stderr").read_text()
    assert process.returncode == 0, f"{what} failed:\n{stdout}\n{stderr[-4000:]}"
    return stdout, out_dir
