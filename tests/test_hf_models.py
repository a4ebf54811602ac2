"""Hugging Face models under ``fully_shard``, eagerly and under fsdp_inductor, against one process.

A Llama (``LlamaForCausalLM``) and a GPT-2 with tied input and output embeddings
(``GPT2LMHeadModel``), four layers each, ``fully_shard`` on every layer and the root, 2 ranks,
three SGD steps on the global batch split across ranks. Needs ``transformers``, which the
project does not install: ``pip install transformers`` to run these (skipped otherwise).
"""
from __future__ import annotations

import warnings
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from fsdp_compile import fully_shard
from fsdp_compile.compile.backend import observe_graphs
from fsdp_compile.passes.graph import GROUP_KEY, REDUCE_SCATTER, fsdp_annotation

pytest.importorskip("transformers")

STEPS = 3


def _build(kind: str) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
        )
        model = transformers.LlamaForCausalLM(config)
        return model, model.model.layers
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=4, n_head=4, n_positions=32, use_cache=False, tie_word_embeddings=True,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config)
    return model, model.transformer.h


class HFRun(NamedTuple):
    tied: bool
    losses: list[float]
    reference_losses: list[float]
    max_param_gap: float  # against the single-process model after the steps
    max_param_moved: float  # how far the steps moved the reference's parameters
    # Per compiled backward graph, the groups it reduce-scatters.
    backward_groups: list[list[str]] = []


def _enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    with warnings.catch_warnings():  # transformers 5.x deprecates the name, as Trainer still calls it
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _train_like_one_process(kind: str, mode: str, checkpointed: bool = False) -> HFRun:
    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2 * world, 12), generator=generator) for _ in range(STEPS)]

    def loss_of(model, tokens):
        return model(input_ids=tokens, labels=tokens, use_cache=False).loss

    reference, _ = _build(kind)
    initial = [p.detach().clone() for p in reference.parameters()]
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    reference_losses = []
    for batch in batches:  # the mean of the ranks' mean losses, as the sharded run averages them
        loss = sum(loss_of(reference, part) for part in batch.chunk(world)) / world
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reference_losses.append(loss.item())

    model, layers = _build(kind)
    if checkpointed:
        _enable_gradient_checkpointing(model)
    tied = kind == "gpt2" and model.lm_head.weight is model.transformer.wte.weight
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    runner = model if mode == "eager" else torch.compile(model, backend="fsdp_inductor")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    with observe_graphs() as graphs:
        for batch in batches:
            loss = loss_of(runner, batch.chunk(world)[rank])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
    backward_groups = [
        sorted({fsdp_annotation(n)[GROUP_KEY] for n in g.graph.nodes if n.target is REDUCE_SCATTER and fsdp_annotation(n)})
        for kind_of_graph, g in graphs if kind_of_graph == "backward"
    ]
    return HFRun(
        tied=tied, losses=losses, reference_losses=reference_losses,
        max_param_gap=max((p.full_tensor() - r).abs().max().item() for p, r in zip(model.parameters(), reference.parameters())),
        max_param_moved=max((r - i).abs().max().item() for r, i in zip(reference.parameters(), initial)),
        backward_groups=backward_groups,
    )


@pytest.mark.parametrize("mode", ["eager", "fsdp_inductor"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hugging_face_model_trains_like_one_process(dist, kind, mode):
    result = dist.run(2, _train_like_one_process, kind, mode)[0]
    assert result.tied == (kind == "gpt2"), result
    for loss, reference in zip(result.losses, result.reference_losses, strict=True):
        assert abs(loss - reference) <= 1e-5 * abs(reference), result
    assert result.max_param_moved > 1e-3, result  # the steps moved the parameters: the gap below can fail
    assert result.max_param_gap <= 1e-5, result


def test_hugging_face_layers_under_gradient_checkpointing_compile_as_one_frame_and_train_like_one_process(dist):
    """Hugging Face's gradient checkpointing checkpoints each layer in its own call (in forward, from
    transformers 5.x, for every subclass: ours too), where a frame entered in our forward could not
    break the graph: every layer compiled in one backward graph. Entered in __call__ ([Note: a block
    that checkpoints itself in __call__] in fsdp_compile/module.py), the four layers share one block
    frame, whose backward reduce-scatters each layer's gradients, and training equals one process."""
    result = dist.run(2, _train_like_one_process, "llama", "fsdp_inductor", True)[0]
    for loss, reference in zip(result.losses, result.reference_losses, strict=True):
        assert abs(loss - reference) <= 1e-5 * abs(reference), result
    assert result.max_param_moved > 1e-3 and result.max_param_gap <= 1e-5, result
    frames = [groups for groups in result.backward_groups if groups == ["LlamaDecoderLayer (block frame)"]]
    assert len(frames) == 1 and not any("model.layers." in group for groups in result.backward_groups for group in groups), result
