"""unshard_params (FSDP1's summon_full_params): reads, writeback, rank0_only, grads, and misuse."""
from __future__ import annotations

import copy
import warnings
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import fsdp_compile
from fsdp_compile.models import next_token_loss
from fsdp_testing import SMALL, UNEVEN, build_reference, global_batches, local_part, shard_model


def _sharded_copy(reference, **kwargs):
    return shard_model(copy.deepcopy(reference), fsdp_compile.fully_shard, **kwargs)


def _tokens():
    return local_part(global_batches(1, 2, dist.get_world_size(), config=UNEVEN)[0])


class FullParams(NamedTuple):
    inside: bool  # inside unshard_params: plain full parameters equal to the reference's
    names: bool  # under the reference's names
    after: bool  # sharded DTensors again after it


def _reads_full_params():
    reference = build_reference(UNEVEN)
    model = _sharded_copy(reference)
    with fsdp_compile.unshard_params(model):
        inside = [
            type(p) is torch.nn.Parameter and not isinstance(p.data, DTensor) and torch.equal(p, r)
            for p, r in zip(model.parameters(), reference.parameters())
        ]
        names = [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    after = all(isinstance(p.data, DTensor) for p in model.parameters())
    return FullParams(all(inside), names, after)


def test_full_parameters_are_plain_tensors_inside_and_shards_after(dist):
    for result in dist.run(2, _reads_full_params):
        assert result.inside and result.names and result.after


def _writeback(writeback: bool):
    reference = build_reference(UNEVEN)
    model = _sharded_copy(reference)
    with fsdp_compile.unshard_params(model, writeback=writeback):
        for param in model.parameters():
            param.data.mul_(2)
    factor = 2 if writeback else 1
    return all(torch.equal(p.full_tensor(), factor * r) for p, r in zip(model.parameters(), reference.parameters()))


@pytest.mark.parametrize("writeback", [True, False])
def test_in_place_edits_reach_the_shards_only_with_writeback(dist, writeback):
    assert all(dist.run(2, _writeback, writeback))


class RecordedGathers(NamedTuple):
    recorded: list[tuple[str, str, str]]  # (kind, group, reason) of every collective
    names: list[str]  # the model's parameter names
    keys: list[str]  # its state-dict keys (tied weights: one each)


def _recorded_gathers():
    reference = build_reference(UNEVEN)
    model = _sharded_copy(reference)
    next_token_loss(model(_tokens()), _tokens()).backward()
    with fsdp_compile.record_collectives() as log:
        with fsdp_compile.unshard_params(model, with_grads=True):
            pass
        with fsdp_compile.state_dict_type(model, fsdp_compile.StateDictType.FULL_STATE_DICT):
            model.state_dict()
    names = [n for n, _ in reference.named_parameters()]
    keys = [n for n, _ in reference.named_parameters(remove_duplicate=False)]  # tied weights: one key each
    return RecordedGathers([(r.kind, r.group, r.reason) for r in log], names, keys)


def test_unshard_params_and_full_state_dict_gathers_are_recorded(dist):
    result = dist.run(2, _recorded_gathers)[0]
    recorded, names, keys = result.recorded, result.names, result.keys
    assert {kind for kind, _, _ in recorded} == {"all_gather"}
    for reason, expected in (("unshard_params", names), ("unshard_params-grad", names), ("state_dict", keys)):
        gathered = [group for _, group, why in recorded if why == reason]
        # One gather per parameter (per state-dict key), named by its path inside its fully_shard module.
        assert len(gathered) == len(expected), reason
        assert all(any(name.endswith(param) for name in names) for param in gathered), reason


def _edited_params_are_used_by_the_next_forward():
    reference = build_reference(UNEVEN)
    model = _sharded_copy(reference)
    tokens = _tokens()
    model(tokens)  # lazy init and one step's bookkeeping before the edit
    with fsdp_compile.unshard_params(model):
        model.output.weight.data.zero_()
    with torch.no_grad():
        reference.output.weight.zero_()
        return (model(tokens) - reference(tokens)).abs().max().item()


def test_forward_after_writeback_uses_the_edited_values(dist):
    assert dist.run(2, _edited_params_are_used_by_the_next_forward) == [0.0, 0.0]


class Rank0Only(NamedTuple):
    sharded_kinds: set[bool]  # whether each parameter inside the context is a DTensor
    full_equal: bool  # rank 0: full CPU parameters equal to the reference's; other ranks: True


def _rank0_only():
    reference = build_reference(UNEVEN)
    model = _sharded_copy(reference)
    with fsdp_compile.unshard_params(model, writeback=False, rank0_only=True, offload_to_cpu=True):
        kinds = {isinstance(p.data, DTensor) for p in model.parameters()}
        full_equal = dist.get_rank() != 0 or all(
            torch.equal(p, r) and p.device.type == "cpu" for p, r in zip(model.parameters(), reference.parameters())
        )
    return Rank0Only(kinds, full_equal)


def test_rank0_only_shows_full_params_on_rank_0_and_shards_elsewhere(dist):
    rank0, rank1 = dist.run(2, _rank0_only)
    assert rank0.sharded_kinds == {False} and rank0.full_equal
    assert rank1.sharded_kinds == {True} and rank1.full_equal


class FullGrads(NamedTuple):
    seen: bool  # inside the context each parameter's grad is its full gradient
    written: bool  # an in-place edit of it reached the sharded gradient


def _with_grads():
    reference = build_reference(UNEVEN)
    model = _sharded_copy(reference)
    tokens = _tokens()
    next_token_loss(model(tokens), tokens).backward()
    expected = [p.grad.full_tensor() for p in model.parameters()]
    with fsdp_compile.unshard_params(model, with_grads=True):
        seen = all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))
        for param in model.parameters():
            param.grad.mul_(3)
    written = all(torch.equal(p.grad.full_tensor(), 3 * g) for p, g in zip(model.parameters(), expected))
    return FullGrads(seen, written)


def test_with_grads_exposes_full_gradients_and_writes_edits_back(dist):
    for result in dist.run(2, _with_grads):
        assert result.seen and result.written


def _misuse(case: str):
    from torch.distributed.device_mesh import init_device_mesh

    model = _sharded_copy(build_reference(SMALL))
    try:
        if case == "writeback_rank0_only":
            with fsdp_compile.unshard_params(model, writeback=True, rank0_only=True):
                pass
        elif case == "with_grads_offload":
            with fsdp_compile.unshard_params(model, with_grads=True, offload_to_cpu=True, rank0_only=True, writeback=False):
                pass
        elif case == "offload_one_rank_shards":
            mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
            replicated = _sharded_copy(build_reference(SMALL), mesh=mesh)
            with fsdp_compile.unshard_params(replicated, offload_to_cpu=True, rank0_only=True, writeback=False):
                pass
        elif case == "nested":
            with fsdp_compile.unshard_params(model):
                with fsdp_compile.unshard_params(model.layers[0]):
                    pass
        elif case == "during_forward":
            layer = model.layers[1]
            layer.attention.register_forward_hook(lambda *args: fsdp_compile.unshard_params(layer).__enter__())
            model(local_part(global_batches(1, 2, dist.get_world_size())[0]))
        elif case == "state_dict_inside":
            with fsdp_compile.unshard_params(model):
                model.state_dict()
        elif case == "offload_without_rank0_only_warns":
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with fsdp_compile.unshard_params(model, offload_to_cpu=True):
                    pass
            return "warning: " + " ".join(str(w.message) for w in caught)
    except (RuntimeError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return None


@pytest.mark.parametrize(
    "case, expected",
    [
        ("writeback_rank0_only", "NotImplementedError: unshard_params(writeback=True, rank0_only=True) is not supported"),
        ("with_grads_offload", "NotImplementedError: unshard_params(with_grads=True, offload_to_cpu=True) is not supported"),
        ("offload_one_rank_shards", "NO_SHARD-like"),
        ("nested", "nesting is not supported"),
        ("during_forward", "unshard_params() on 'layers.1' while it is in FORWARD"),
        ("state_dict_inside", "state_dict() on '"),
        ("offload_without_rank0_only_warns", "warning: unshard_params(offload_to_cpu=True, rank0_only=False)"),
    ],
)
def test_unshard_params_misuse_is_reported_clearly(dist, case, expected):
    message = dist.run(2, _misuse, case)[0]
    assert message is not None and expected in message, message


def _model_usable_after_error():
    reference = build_reference(SMALL)
    model = _sharded_copy(reference)
    try:
        with fsdp_compile.unshard_params(model):
            with fsdp_compile.unshard_params(model):
                pass
    except RuntimeError:
        pass
    restored = all(isinstance(p.data, DTensor) for p in model.parameters())
    with fsdp_compile.unshard_params(model, writeback=False):
        pass  # enterable again: the failed context cleaned up
    return restored


def test_failed_unshard_params_restores_the_sharded_parameters(dist):
    assert all(dist.run(2, _model_usable_after_error))
