"""State dicts: sharded (DCP, resharding, PyTorch FSDP2 interop), full, local, and their hooks."""
from __future__ import annotations

import copy
import os
import re
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict,
)
from torch.distributed.tensor import DTensor

import fsdp_compile
from fsdp_compile import FullStateDictConfig, StateDictType
from fsdp_compile.models import next_token_loss
from fsdp_testing import SMALL, UNEVEN, build_reference, global_batches, local_part, mean_across_ranks, shard_model

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 12 rows split evenly over 1, 2, 3 and 4 ranks: the same global batches at every world size.
GLOBAL_ROWS = 12


def _batches() -> list[torch.Tensor]:
    return global_batches(steps=4, batch_per_rank=GLOBAL_ROWS // 2, world_size=2, config=UNEVEN)


def _train(model, optimizer, batches) -> list[float]:
    losses = []
    for batch in batches:
        local = local_part(batch)
        loss = next_token_loss(model(local), local)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_across_ranks(loss.item()))
    return losses


def _build(fully_shard=fsdp_compile.fully_shard, seed: int = 0):
    model = shard_model(build_reference(UNEVEN, seed=seed), fully_shard)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _full_snapshot(model, optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer-state tensor, gathered to full plain tensors, by FQN."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    flat = {f"model.{k}": v for k, v in model_sd.items()}
    for fqn, per_param in optim_sd["state"].items():
        for name, value in per_param.items():
            flat[f"optim.{fqn}.{name}"] = value
    return {k: v.detach().clone() for k, v in flat.items() if isinstance(v, torch.Tensor)}


def _dcp_load(model, optimizer, checkpoint: str) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _mismatches(actual: dict, expected: dict) -> list[str]:
    if set(actual) != set(expected):
        return [f"keys differ: {sorted(set(actual) ^ set(expected))}"]
    return [k for k in expected if actual[k].dtype != expected[k].dtype or not torch.equal(actual[k], expected[k])]


# --- DCP with resharding ------------------------------------------------------------------------


def _train_save_and_continue(directory: str) -> None:
    """World size 2: train 2 steps, checkpoint with DCP, record the full state and 2 more losses."""
    batches = _batches()
    model, optimizer = _build()
    _train(model, optimizer, batches[:2])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    assert all(isinstance(v, DTensor) for v in model_sd.values())
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(directory, "dcp"))
    snapshot = _full_snapshot(model, optimizer)
    continued = _train(model, optimizer, batches[2:])
    if dist.get_rank() == 0:
        torch.save({"snapshot": snapshot, "continued": continued}, os.path.join(directory, "expected.pt"))
    dist.barrier()


class LoadedCheckpoint(NamedTuple):
    mismatched: list[str]  # full parameters / optimizer states that differ from the saved ones
    continued_losses: list[float]  # training on after loading
    expected_losses: list[float]  # the saving run's, training on after saving


def _load_and_continue(directory: str, fully_shard_name: str = "ours"):
    if fully_shard_name == "ours":
        fully_shard = fsdp_compile.fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    model, optimizer = _build(fully_shard, seed=123)  # other initial values: loading must overwrite all
    _dcp_load(model, optimizer, os.path.join(directory, "dcp"))
    expected = torch.load(os.path.join(directory, "expected.pt"))
    mismatched = _mismatches(_full_snapshot(model, optimizer), expected["snapshot"])
    continued = _train(model, optimizer, _batches()[2:])
    return LoadedCheckpoint(mismatched, continued, expected["continued"])


@pytest.fixture(scope="module")
def checkpoint_at_world_size_2(dist, tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("dcp_world2"))
    dist.run(2, _train_save_and_continue, directory)
    return directory


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_dcp_checkpoint_from_2_ranks_loads_bitwise_and_training_continues(dist, checkpoint_at_world_size_2, world_size):
    result = dist.run(world_size, _load_and_continue, checkpoint_at_world_size_2)[0]
    assert result.mismatched == [], f"parameters / AdamW state differ after loading at world size {world_size}: {result.mismatched}"
    # Other world sizes sum gradients in another order: equal up to float rounding, not bitwise.
    assert result.continued_losses == pytest.approx(result.expected_losses, rel=1e-5), (result.continued_losses, result.expected_losses)


def test_our_dcp_checkpoint_loads_into_torch_fully_shard_bitwise(dist, checkpoint_at_world_size_2):
    result = dist.run(2, _load_and_continue, checkpoint_at_world_size_2, "torch")[0]
    assert result.mismatched == []
    assert result.continued_losses == result.expected_losses


class TorchCheckpointLoaded(NamedTuple):
    mismatched: list[str]  # full parameters / optimizer states that differ from torch's
    our_losses: list[float]  # training on after loading
    torch_losses: list[float]  # torch's fully_shard training on after saving


def _torch_saves_ours_loads(directory: str):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    batches = _batches()
    theirs, their_optimizer = _build(torch_fully_shard)
    _train(theirs, their_optimizer, batches[:2])
    model_sd, optim_sd = get_state_dict(theirs, their_optimizer)
    checkpoint = os.path.join(directory, "torch_dcp")
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)
    expected = _full_snapshot(theirs, their_optimizer)
    ours, our_optimizer = _build(seed=123)
    _dcp_load(ours, our_optimizer, checkpoint)
    mismatched = _mismatches(_full_snapshot(ours, our_optimizer), expected)
    return TorchCheckpointLoaded(mismatched, _train(ours, our_optimizer, batches[2:]), _train(theirs, their_optimizer, batches[2:]))


def test_torch_fully_shard_dcp_checkpoint_loads_into_ours_bitwise(dist, tmp_path):
    result = dist.run(2, _torch_saves_ours_loads, str(tmp_path))[0]
    assert result.mismatched == []
    assert result.our_losses == result.torch_losses


# --- sharded (default) ----------------------------------------------------------------------------


class ShardedStateDict(NamedTuple):
    names_match: bool  # the unsharded model's FQNs, in its order
    all_dtensor: bool  # every value a DTensor sharded on dim 0
    doubled: bool  # loading the doubled dict back doubled the parameters


def _default_state_dict_is_sharded():
    reference = build_reference(SMALL)
    model = shard_model(copy.deepcopy(reference), fsdp_compile.fully_shard)
    state = model.state_dict()
    names_match = list(state) == list(reference.state_dict())
    all_dtensor = all(isinstance(v, DTensor) and v.placements[0].is_shard(0) for v in state.values())
    # Loading the (edited) sharded dict back changes the shards in place.
    edited = {k: v * 2 for k, v in state.items()}
    model.load_state_dict(edited)
    doubled = all(torch.equal(p.full_tensor(), 2 * r) for p, r in zip(model.parameters(), reference.parameters()))
    return ShardedStateDict(names_match, all_dtensor, doubled)


def test_default_state_dict_is_dtensors_under_original_names_and_loads_back(dist):
    for result in dist.run(2, _default_state_dict_is_sharded):
        assert result.names_match and result.all_dtensor and result.doubled


class CompiledNames(NamedTuple):
    plain_names: bool  # torch.compile(model).state_dict() under the original FQNs
    version_kept: bool  # with the wrapped model's metadata
    doubled: bool  # load_state_dict on the wrapper took the original FQNs
    restored: bool  # and the "_orig_mod."-prefixed ones
    dcp_names: bool  # get_model_state_dict(torch.compile(model)) under the original FQNs
    tripled: bool  # set_model_state_dict on the wrapper loaded
    in_place_names: bool  # model.compile() kept the original FQNs


def _compiled_model_keeps_original_names():
    reference = build_reference(SMALL)
    model = shard_model(copy.deepcopy(reference), fsdp_compile.fully_shard)
    compiled = torch.compile(model)
    names = list(reference.state_dict())
    plain = compiled.state_dict()
    plain_names = list(plain) == names
    version_kept = plain._metadata[""] == model.state_dict()._metadata[""]
    # Loading accepts the original names and the wrapper's prefixed ones alike, strictly.
    compiled.load_state_dict({k: v * 2 for k, v in plain.items()})
    doubled = all(torch.equal(p.full_tensor(), 2 * r) for p, r in zip(model.parameters(), reference.parameters()))
    compiled.load_state_dict({"_orig_mod." + k: v / 2 for k, v in plain.items()})  # plain aliases the params
    restored = all(torch.equal(p.full_tensor(), r) for p, r in zip(model.parameters(), reference.parameters()))
    model_sd = get_model_state_dict(compiled)
    dcp_names = list(model_sd) == names
    set_model_state_dict(compiled, {k: v * 3 for k, v in model_sd.items()})
    tripled = all(torch.equal(p.full_tensor(), 3 * r) for p, r in zip(model.parameters(), reference.parameters()))
    model.compile()  # in place: no wrapper, no prefix
    in_place_names = list(model.state_dict()) == names
    return CompiledNames(plain_names, version_kept, doubled, restored, dcp_names, tripled, in_place_names)


def test_compiled_model_checkpoints_under_original_names(dist):
    result = dist.run(2, _compiled_model_keeps_original_names)[0]
    assert result.plain_names, "torch.compile(model).state_dict() must use the original FQNs, no '_orig_mod.'"
    assert result.version_kept, "the wrapped model's state-dict metadata must survive the renaming"
    assert result.doubled and result.restored, "load_state_dict on the compiled wrapper must take both spellings"
    assert result.dcp_names and result.tripled, "get/set_model_state_dict(torch.compile(model)) must use the original FQNs"
    assert result.in_place_names, "model.compile() must keep the original FQNs"


class StateDictMidStep(NamedTuple):
    values_ok: bool  # state_dict() between forward and backward held the full reference values
    same_grads: bool  # and backward then gave the gradients it gives without that call


def _state_dict_between_forward_and_backward():
    reference = build_reference(SMALL)
    tokens = local_part(global_batches(1, 2, dist.get_world_size())[0])
    results = []
    for call_state_dict in (False, True):
        model = shard_model(copy.deepcopy(reference), fsdp_compile.fully_shard, reshard_after_forward=False)
        loss = next_token_loss(model(tokens), tokens)
        if call_state_dict:
            state = model.state_dict()
            values_ok = all(
                isinstance(v, DTensor) and torch.equal(v.full_tensor(), r)
                for v, r in zip(state.values(), reference.state_dict().values())
            )
        loss.backward()
        results.append([p.grad.full_tensor() for p in model.parameters()])
    same_grads = all(torch.equal(a, b) for a, b in zip(*results))
    return StateDictMidStep(values_ok, same_grads)


def test_state_dict_between_forward_and_backward_is_correct_and_backward_still_works(dist):
    for result in dist.run(2, _state_dict_between_forward_and_backward):
        assert result.values_ok and result.same_grads


def _state_dict_inside_forward_raises():
    model = shard_model(build_reference(SMALL), fsdp_compile.fully_shard)
    layer = model.layers[0]
    layer.attention.register_forward_hook(lambda module, args, output: layer.state_dict())
    tokens = local_part(global_batches(1, 2, dist.get_world_size())[0])
    try:
        model(tokens)
    except RuntimeError as error:
        return str(error)
    return None


def test_state_dict_during_forward_raises_clear_error(dist):
    message = dist.run(2, _state_dict_inside_forward_raises)[0]
    assert message is not None and "state_dict() on 'layers.0' while it is in FORWARD" in message
    assert "outside forward/backward" in message


# --- full -----------------------------------------------------------------------------------------


class FullStateDictRank0(NamedTuple):
    ok: bool  # rank 0: equal to the reference's, as CPU tensors; other ranks: empty
    type_after: StateDictType  # the state-dict type once the context has exited


def _full_state_dict_rank0_only_offload():
    reference = build_reference(SMALL)
    model = shard_model(copy.deepcopy(reference), fsdp_compile.fully_shard)
    config = FullStateDictConfig(rank0_only=True, offload_to_cpu=True)
    with fsdp_compile.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        full = model.state_dict()
    after = fsdp_compile.get_state_dict_type(model).state_dict_type
    expected = reference.state_dict()
    if dist.get_rank() != 0:
        return FullStateDictRank0(full == {}, after)
    equal = list(full) == list(expected) and all(
        type(full[k]) is torch.Tensor and full[k].device.type == "cpu" and torch.equal(full[k], expected[k]) for k in expected
    )
    return FullStateDictRank0(equal, after)


def test_full_state_dict_rank0_only_offload_equals_reference_state_dict(dist):
    for rank, result in enumerate(dist.run(2, _full_state_dict_rank0_only_offload)):
        assert result.ok, f"rank {rank}: full state dict wrong (rank 0: equal to reference; others: empty)"
        assert result.type_after == StateDictType.SHARDED_STATE_DICT, "the context must restore the default"


def _loading_full_state_dict_reproduces_outputs(rank0_only: bool):
    reference = build_reference(SMALL)
    model = shard_model(build_reference(SMALL, seed=7), fsdp_compile.fully_shard)
    full = reference.state_dict() if (not rank0_only or dist.get_rank() == 0) else {}
    with fsdp_compile.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=rank0_only)):
        model.load_state_dict(full)
    tokens = local_part(global_batches(1, 2, dist.get_world_size())[0])
    with torch.no_grad():
        return (model(tokens) - reference(tokens)).abs().max().item()


@pytest.mark.parametrize("rank0_only", [False, True], ids=["every_rank", "rank0_broadcast"])
def test_loading_full_state_dict_reproduces_reference_outputs(dist, rank0_only):
    for difference in dist.run(2, _loading_full_state_dict_reproduces_outputs, rank0_only):
        assert difference == 0.0


def _plain_full_tensors_load_by_default():
    reference = build_reference(UNEVEN)
    model = shard_model(build_reference(UNEVEN, seed=5), fsdp_compile.fully_shard)
    model.load_state_dict(reference.state_dict())
    return all(torch.equal(p.full_tensor(), r) for p, r in zip(model.parameters(), reference.parameters()))


def test_default_load_accepts_full_plain_tensors_with_uneven_rows(dist):
    assert all(dist.run(4, _plain_full_tensors_load_by_default))


# --- local ----------------------------------------------------------------------------------------


class SavedLocal(NamedTuple):
    output_shape: torch.Size  # of output.weight's local shard
    plain: bool  # every value a plain tensor


def _save_local(directory: str):
    model = shard_model(build_reference(UNEVEN), fsdp_compile.fully_shard)
    with fsdp_compile.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        local = model.state_dict()
    torch.save(local, os.path.join(directory, f"local_{dist.get_rank()}.pt"))
    padded = local["output.weight"].shape  # 37 rows over 2 ranks: 19 each, the last one padded
    return SavedLocal(padded, all(type(v) is torch.Tensor for v in local.values()))


def _load_local(directory: str, saved_world: int):
    reference = build_reference(UNEVEN)
    model = shard_model(build_reference(UNEVEN, seed=9), fsdp_compile.fully_shard)
    local = torch.load(os.path.join(directory, f"local_{dist.get_rank() % saved_world}.pt"), weights_only=False)
    with fsdp_compile.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        try:
            model.load_state_dict(local)
        except ValueError as error:
            return str(error)
    return all(torch.equal(p.full_tensor(), r) for p, r in zip(model.parameters(), reference.parameters()))


def test_local_state_dict_is_padded_shards_and_round_trips_at_same_world_size(dist, tmp_path):
    saved = dist.run(2, _save_local, str(tmp_path))[0]
    assert saved.output_shape == (19, UNEVEN.dim) and saved.plain
    assert dist.run(2, _load_local, str(tmp_path), 2) == [True, True]


def test_local_state_dict_at_other_world_size_raises_clear_error(dist, tmp_path):
    dist.run(2, _save_local, str(tmp_path))
    message = dist.run(4, _load_local, str(tmp_path), 2)[0]
    assert isinstance(message, str)
    assert "saved at shard world size 2" in message and "shards over 4 ranks" in message
    assert "SHARDED_STATE_DICT" in message


# --- README ---------------------------------------------------------------------------------------


def _run_readme_checkpointing_example(directory: str) -> bool:
    with open(os.path.join(REPO_DIR, "README.md")) as file:
        readme = file.read()
    section = readme.split("## Checkpointing", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "README's Checkpointing section has no python example"
    os.environ["CHECKPOINT_DIR"] = os.path.join(directory, "readme_checkpoint")
    namespace: dict = {}
    exec(compile("\n".join(blocks), "README.md#Checkpointing", "exec"), namespace)
    return True


def test_readme_checkpointing_example_runs(dist, tmp_path):
    assert dist.run(2, _run_readme_checkpointing_example, str(tmp_path)) == [True, True]
