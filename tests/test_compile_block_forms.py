"""Every way a user compiles a block composes with ``fully_shard`` as with PyTorch FSDP2: the block's
forward compiled alone, the FSDP hooks eager around it ([Note: every way of compiling a block, one
form] in module.py), whatever the order of compile and ``fully_shard``, the backend, ``fullgraph``,
activation checkpointing or mixed precision. Each case trains a two-block model two steps on 2 ranks
against the same model trained eagerly: bitwise under aot_eager, within Inductor's tolerance else.
"""
from __future__ import annotations

import copy
import functools
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fsdp_compile import MixedPrecisionPolicy, fully_shard
from fsdp_compile.compile.compiled_state import CompiledFSDPState as FSDPState

DIM, VOCAB, LAYERS, STEPS = 16, 32, 2, 2
# The frames Dynamo compiles of the hooks (the registered hooks are frames it skips): [Note: hook frames
# under block frames] in compile/compiled_state.py.
_HOOKS = (FSDPState._pre_forward_hook_frame, FSDPState._post_forward_hook_frame)

# How the block is compiled, in the order the user writes it:
#   wrapper_before: model.layers[i] = torch.compile(block); then fully_shard (torchtitan before 0.3)
#   wrapper_after:  fully_shard(block); model.layers[i] = torch.compile(block); fully_shard(model)
#   in_place_before: block.compile(); then fully_shard (torchtitan 0.3's apply_compile)
#   in_place_between: fully_shard(block); block.compile(); fully_shard(model)
#   in_place_after: fully_shard(block); fully_shard(model); block.compile()
FORMS = ["wrapper_before", "wrapper_after", "in_place_before", "in_place_between", "in_place_after"]


class Block(nn.Module):
    """A residual MLP; ``checkpoint_body``: its forward checkpoints its own body (torch.utils.checkpoint
    inside the compiled forward)."""

    def __init__(self, checkpoint_body: bool = False) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, 2 * DIM)
        self.w2 = nn.Linear(2 * DIM, DIM)
        self.checkpoint_body = checkpoint_body

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.silu(self.w1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_body:
            return checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


class Model(nn.Module):
    """``checkpoint_calls``: the model checkpoints each block's call (Hugging Face's gradient checkpointing)."""

    def __init__(self, checkpoint_body: bool, checkpoint_calls: bool) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(checkpoint_body) for _ in range(LAYERS))
        self.output = nn.Linear(DIM, VOCAB)
        self.checkpoint_calls = checkpoint_calls

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpoint_calls else layer(x)
        return self.output(x)


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """torchtitan's selective activation checkpointing, in small: matmuls saved, the rest recomputed."""
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


def _build(checkpointing: str) -> Model:
    torch.manual_seed(0)
    model = Model(checkpoint_body=checkpointing == "body", checkpoint_calls=checkpointing == "calls")
    for index, block in enumerate(model.layers):
        if checkpointing == "wrapper":
            model.layers.register_module(str(index), checkpoint_wrapper(block))
        elif checkpointing == "selective":
            context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
            model.layers.register_module(str(index), checkpoint_wrapper(block, context_fn=context, preserve_rng_state=False))
    return model


def _shard_and_compile(model: Model, form: str, policy: MixedPrecisionPolicy, compile_kwargs: dict) -> Model:
    layers = model.layers
    if form == "wrapper_before":
        for index, block in enumerate(list(layers)):
            layers.register_module(str(index), torch.compile(block, **compile_kwargs))
    if form == "in_place_before":
        for block in layers:
            block.compile(**compile_kwargs)
    for index, block in enumerate(list(layers)):
        fully_shard(block, mp_policy=policy)
        if form == "wrapper_after":
            layers.register_module(str(index), torch.compile(block, **compile_kwargs))
        if form == "in_place_between":
            block.compile(**compile_kwargs)
    fully_shard(model, mp_policy=policy)
    if form == "in_place_after":
        for block in layers:
            block.compile(**compile_kwargs)
    return model


def _train(model: nn.Module) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


class FormRun(NamedTuple):
    eager_losses: list[float]
    compiled_losses: list[float]
    max_param_gap: float  # against the eager model after the steps
    max_param_moved: float  # how far the steps moved the eager model's parameters
    graphs: int  # Dynamo graphs compiled: the blocks' forward, shared by identical blocks
    hook_frames: int  # FSDP hooks Dynamo compiled as frames of their own (FSDP2's never are)


def _compiled_block_trains_like_eager(form: str, backend: str, fullgraph: bool, checkpointing: str, dtype: str) -> FormRun:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)
    reference = _build(checkpointing)
    initial = [p.detach().clone() for p in reference.parameters()]
    eager = _shard_and_compile(copy.deepcopy(reference), "eager", policy, {})
    compiled = _shard_and_compile(copy.deepcopy(reference), form, policy, {"backend": backend, "fullgraph": fullgraph})
    eager_losses, compiled_losses = _train(eager), _train(compiled)
    pairs = list(zip(eager.parameters(), compiled.parameters(), initial))
    return FormRun(
        eager_losses, compiled_losses,
        max((a.full_tensor() - b.full_tensor()).abs().max().item() for a, b, _ in pairs),
        max((a.full_tensor() - start).abs().max().item() for a, _, start in pairs),
        torch._dynamo.utils.counters["stats"]["unique_graphs"],
        sum(len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(hook.__code__)) for hook in _HOOKS),
    )


def _check(run: FormRun, bitwise: bool) -> None:
    assert run.hook_frames == 0, run  # the hooks ran eagerly around the compiled forward
    assert run.max_param_moved > 1e-3, run  # the steps trained something
    assert run.graphs >= 1, run  # and the blocks ran compiled
    if bitwise:
        assert run.compiled_losses == run.eager_losses, run
        assert run.max_param_gap == 0.0, run
    else:
        for eager, compiled in zip(run.eager_losses, run.compiled_losses):
            assert abs(eager - compiled) <= 1e-3 * abs(eager), run
        assert run.max_param_gap < 1e-3, run


# Every form under aot_eager (bitwise), each with another checkpointing, fullgraph and dtype.
@pytest.mark.parametrize(
    "form, fullgraph, checkpointing, dtype",
    [
        ("wrapper_before", True, "none", "float32"),
        ("wrapper_after", False, "wrapper", "bfloat16"),
        ("in_place_before", True, "selective", "bfloat16"),
        ("in_place_between", True, "body", "float32"),
        ("in_place_after", False, "calls", "float32"),
    ],
)
def test_block_compiled_any_way_under_aot_eager_trains_bitwise_like_eager(dist, form, fullgraph, checkpointing, dtype):
    run = dist.run(2, _compiled_block_trains_like_eager, form, "aot_eager", fullgraph, checkpointing, dtype)[0]
    _check(run, bitwise=True)


# Inductor's and fsdp_inductor's code: torchtitan's recipe (in place, before fully_shard, fullgraph,
# selective checkpointing, bf16), and fsdp_inductor once (the other forms are aot_eager's above: the
# form decides what is compiled, not the backend; each Inductor case costs the suite seconds).
@pytest.mark.parametrize(
    "form, backend, fullgraph, checkpointing, dtype",
    [
        ("in_place_before", "inductor", True, "selective", "bfloat16"),
        ("in_place_between", "fsdp_inductor", True, "wrapper", "float32"),
    ],
)
def test_block_compiled_any_way_under_inductor_trains_like_eager(dist, form, backend, fullgraph, checkpointing, dtype):
    run = dist.run(2, _compiled_block_trains_like_eager, form, backend, fullgraph, checkpointing, dtype)[0]
    _check(run, bitwise=False)
