"""Compiled training as real loops run it: per-rank shapes and rank-local recompiles, evaluation
mid-training, checkpointed blocks, gradient clipping and accumulation, skipped blocks, an
optimizer built too early; each compiled against our eager runtime (fsdp_aot_eager: fsdp_inductor's
trace, checks and graph passes, without the code generation test_compile.py checks)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from fsdp_compile import fully_shard
from fsdp_compile.models import Transformer, TransformerConfig, next_token_loss
from fsdp_testing import TinyLM, shard_model

# Two small blocks: enough for prefetch across groups, cheap to compile on 2 cores.
TINY = TransformerConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=16)


def _tokens(rows: int, seq: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, TINY.vocab_size, (rows, 1), generator=generator)
    return (start + torch.arange(seq)) % TINY.vocab_size


def _pair(build):
    """Our eager model and an identical one to compile (``build()``), sharded the same way."""
    torch.manual_seed(0)
    reference = build()
    return shard_model(copy.deepcopy(reference), fully_shard), shard_model(copy.deepcopy(reference), fully_shard)


def _sgd_step(model, runner, tokens, optimizer) -> float:
    loss = next_token_loss(runner(tokens), tokens)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _max_param_gap(a, b) -> float:
    return max((x.full_tensor() - y.full_tensor()).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


# --- per-rank shapes: rank-local recompiles --------------------------------------------------------


def _per_rank_shapes(dynamic):
    torch._dynamo.reset()
    rank = dist.get_rank()
    # TinyLM: the collectives do not depend on the batch's shape whatever the blocks are, and
    # each recompile below retraces the whole model (a transformer's ops cost seconds each time).
    # Its blocks' regions reshape their input with symbolic sizes once shapes turn dynamic, which
    # the region pass once copied with the region's input tensor in place of the size (passes/recompute.py).
    eager, compiled = _pair(lambda: TinyLM(vocab_size=TINY.vocab_size, dim=16))
    # fsdp_aot_eager: the same Dynamo graphs, cross-rank check and passes as fsdp_inductor, without
    # the Inductor code generation that would make each of the recompiles here cost a minute on
    # 2 cores (Inductor's numerics are checked in test_compile.py).
    runner = torch.compile(compiled, backend="fsdp_aot_eager", dynamic=dynamic)
    # (rows, seq) per step and rank: rank 1's batch grows, then rank 0's sequence shrinks, then a
    # smaller last batch on every rank.
    plan = [((2, 12), (2, 12)), ((2, 12), (3, 12)), ((2, 8), (3, 12)), ((1, 12), (1, 12))]
    eager_opt, compiled_opt = torch.optim.SGD(eager.parameters(), lr=0.1), torch.optim.SGD(compiled.parameters(), lr=0.1)
    graphs, losses = [], []
    for step, shapes in enumerate(plan):
        tokens = _tokens(*shapes[rank], seed=10 * step + rank)
        losses.append((_sgd_step(eager, eager, tokens, eager_opt), _sgd_step(compiled, runner, tokens, compiled_opt)))
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return {"graphs_after_each_step": graphs, "losses": losses, "param_gap": _max_param_gap(eager, compiled)}


@pytest.mark.parametrize("dynamic", [None, False, True])
def test_per_rank_shapes_recompile_on_that_rank_only_and_train_like_eager(dist, dynamic):
    rank0, rank1 = dist.run(2, _per_rank_shapes, dynamic)
    for result in (rank0, rank1):
        for step, (eager, compiled) in enumerate(result["losses"]):
            assert abs(eager - compiled) <= 1e-5 * abs(eager), (step, eager, compiled)
        assert result["param_gap"] < 1e-5
    if dynamic is not True:
        # Step 1 changes rank 1's shape only: only rank 1 compiles again (rank-local recompile).
        assert rank0["graphs_after_each_step"][1] == rank0["graphs_after_each_step"][0]
        assert rank1["graphs_after_each_step"][1] > rank1["graphs_after_each_step"][0]


# --- an optimizer built before fully_shard ---------------------------------------------------------


def _optimizer_before_fully_shard(compile_mode):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Transformer(TINY)
    early = torch.optim.AdamW(model.parameters(), lr=1e-3)  # holds the parameters fully_shard replaces
    shard_model(model, fully_shard)
    runner = torch.compile(model, backend=compile_mode) if compile_mode else model
    tokens = _tokens(2, 12, seed=dist.get_rank())
    next_token_loss(runner(tokens), tokens).backward()
    try:
        early.step()
        message = ""
    except RuntimeError as error:
        message = str(error)
    late = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.full_tensor().clone() for p in model.parameters()]
    late.step()  # the optimizer built after fully_shard steps the shards
    moved = max((a - p.full_tensor()).abs().max().item() for a, p in zip(before, model.parameters()))
    return {"message": message, "late_optimizer_moved": moved}


@pytest.mark.parametrize("compile_mode", [None, "fsdp_aot_eager"])
def test_optimizer_built_before_fully_shard_fails_at_its_first_step_naming_the_fix(dist, compile_mode):
    result = dist.run(2, _optimizer_before_fully_shard, compile_mode)[0]
    assert "AdamW.step() would update a parameter that fully_shard(Transformer" in result["message"], result
    assert "Build the optimizer after fully_shard" in result["message"]
    assert result["late_optimizer_moved"] > 0


# --- the loops people write, compiled --------------------------------------------------------------


class _CheckpointedBlock(nn.Module):
    """A residual block whose feed-forward runs checkpointed inside it (use_reentrant=False)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.feed_forward = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + checkpoint(self.feed_forward, x, use_reentrant=False)


class _SkippingLM(nn.Module):
    """An embedding, checkpointed blocks and a head, with a set of blocks to skip (the same on every
    rank). Small on purpose: what the loops exercise is FSDP's compiled path (Inductor's numerics
    on a transformer are test_compile.py's), and each graph variant below is an Inductor compile."""

    skip: frozenset = frozenset()

    def __init__(self, vocab_size: int = TINY.vocab_size, dim: int = 16, n_layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(_CheckpointedBlock(dim) for _ in range(n_layers))
        self.output = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for index, layer in enumerate(self.layers):
            if index not in self.skip:
                x = layer(x)
        return self.output(x)


def _training_loops():
    """One model eager and one compiled through the same loop; named figures per phase."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    reference = _SkippingLM()
    eager, compiled = shard_model(copy.deepcopy(reference), fully_shard), shard_model(copy.deepcopy(reference), fully_shard)
    runner = torch.compile(compiled, backend="fsdp_aot_eager")
    figures = {"eager": {}, "compiled": {}}
    graphs = []
    rank = dist.get_rank()
    for name, model, run in (("eager", eager, eager), ("compiled", compiled, runner)):
        model.skip = frozenset()  # an instance attribute from the start, as the loop sets it
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        out = figures[name]

        def train_step(seed: int, micro_batches: int = 1) -> float:
            total = 0.0
            for micro in range(micro_batches):
                model.set_requires_gradient_sync(micro == micro_batches - 1)
                tokens = _tokens(2, 12, seed=10 * seed + 3 * micro + rank)
                loss = next_token_loss(run(tokens), tokens) / micro_batches
                loss.backward()
                total += loss.item()
            out.setdefault("grad_norms", []).append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5).item())
            optimizer.step()
            optimizer.zero_grad()
            return total

        def evaluate(seed: int) -> float:
            model.eval()
            with torch.no_grad():
                tokens = _tokens(2, 12, seed=seed + rank)
                value = next_token_loss(run(tokens), tokens).item()
            model.train()
            return value

        out["losses"] = [train_step(0)]
        out["eval"] = [evaluate(50)]
        out["losses"].append(train_step(1, micro_batches=3))  # accumulation without sync
        model.skip = frozenset({1})  # a block skipped on this step, on every rank
        out["losses"].append(train_step(2))
        model.skip = frozenset()
        out["losses"].append(train_step(3))
        if name == "compiled":
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        out["eval"].append(evaluate(60))  # eval and train again: everything seen before, no compile
        out["losses"].append(train_step(4))
        if name == "compiled":
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return {**figures, "graphs": graphs, "param_gap": _max_param_gap(eager, compiled)}


@pytest.fixture(scope="module")
def loops(dist):
    return dist.run(2, _training_loops)[0]


def _close(a: list[float], b: list[float], rtol: float = 1e-5) -> bool:
    return all(abs(x - y) <= rtol * abs(x) for x, y in zip(a, b, strict=True))


def test_checkpointed_blocks_accumulation_and_skipped_blocks_train_like_eager(loops):
    assert _close(loops["eager"]["losses"], loops["compiled"]["losses"]), loops
    assert loops["param_gap"] < 1e-5, loops


def test_eval_with_no_grad_mid_training_matches_eager_and_switching_back_does_not_recompile(loops):
    assert _close(loops["eager"]["eval"], loops["compiled"]["eval"]), loops
    assert loops["graphs"][0] == loops["graphs"][1], loops


def test_clip_grad_norm_over_the_sharded_gradients_matches_eager(loops):
    assert _close(loops["eager"]["grad_norms"], loops["compiled"]["grad_norms"]), loops
    assert max(loops["eager"]["grad_norms"]) > 0.5  # the clip really cut
