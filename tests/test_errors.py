"""Bad input fails at once, with a message naming the module/parameter and the fix."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_compile import fully_shard
from fsdp_compile.models import Transformer
from fsdp_compile.runtime.fully_shard_args import check_param_device
from fsdp_testing import SMALL, build_reference, global_batches, shard_model


def _raises(action) -> str:
    """Run ``action`` on this rank and return the error message ('' if it did not raise)."""
    try:
        action()
    except (ValueError, RuntimeError, TypeError, NotImplementedError, AssertionError) as error:
        return f"{type(error).__name__}: {error}"
    return ""


def _meta_parameters_at_first_forward():
    with torch.device("meta"):
        model = Transformer(SMALL)
    shard_model(model, fully_shard)
    tokens = torch.zeros(2, 8, dtype=torch.long)
    return _raises(lambda: model(tokens))


def test_meta_parameters_fail_at_first_forward_with_the_fix(dist):
    message = dist.run(1, _meta_parameters_at_first_forward)[0]
    assert "tok_embeddings.weight" in message and "meta device" in message and "to_empty" in message
    # FSDP2's words, and every parameter left on meta, of every group (not only the first met).
    assert "FSDP parameters should be materialized from meta device before training" in message
    assert "norm.weight" in message and "attention.wq.weight" in message, message


def _meta_init_flow():
    with torch.device("meta"):
        model = Transformer(SMALL)
    shard_model(model, fully_shard)
    model.to_empty(device="cpu")
    reference = build_reference()
    with torch.no_grad():  # load the reference's values shard by shard, as an init function would
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            mine.to_local().copy_(theirs.chunk(dist.get_world_size())[dist.get_rank()])
    for name, buffer in model.named_buffers():  # non-persistent rotary tables are recomputed by init code
        buffer.copy_(dict(reference.named_buffers())[name])
    tokens = global_batches(1, 2, 1)[0]
    return (model(tokens) - reference(tokens)).abs().max().item()


def test_meta_device_init_then_to_empty_trains(dist):
    assert dist.run(2, _meta_init_flow)[0] < 1e-6


class _Module(nn.Module):
    """A module with a forward: fully_shard refuses containers without one."""

    def forward(self, x):
        return x


class _MixedDtypes(_Module):
    def __init__(self):
        super().__init__()
        self.fp32 = nn.Linear(4, 4)
        self.bf16 = nn.Linear(4, 4).to(torch.bfloat16)


def _mixed_dtypes():
    return _raises(lambda: fully_shard(_MixedDtypes()))


def test_mixed_original_dtypes_in_one_group(dist):
    message = dist.run(1, _mixed_dtypes)[0]
    assert "fp32.weight" in message and "bf16.weight" in message and "MixedPrecisionPolicy" in message


def _twice():
    layer = nn.Linear(4, 4)
    fully_shard(layer)
    return _raises(lambda: fully_shard(layer))


def test_fully_shard_twice_on_one_module(dist):
    assert "AssertionError: Each distinct composable distributed API can only be applied to a module once" in dist.run(1, _twice)[0]


def _tied_across_groups():
    model = build_reference()
    fully_shard(model.tok_embeddings)
    return _raises(lambda: fully_shard(model))


def test_parameter_managed_by_another_group(dist):
    message = dist.run(1, _tied_across_groups)[0]
    assert "output.weight" in message and "already managed by fully_shard(Embedding)" in message
    assert "common ancestor" in message


def _reshard_after_forward_not_dividing():
    return _raises(lambda: fully_shard(nn.Linear(4, 4), reshard_after_forward=3))


def test_int_reshard_after_forward_must_divide_shard_size(dist):
    # Both ranks raise before any collective: nothing hangs.
    for message in dist.run(2, _reshard_after_forward_not_dividing):
        assert "reshard_after_forward=3" in message and "must divide the shard mesh size 2" in message


def test_parameters_on_another_device_than_the_mesh():
    with pytest.raises(ValueError, match=r"'layer.weight' is on cuda:0 but the mesh is on cpu.*init_device_mesh\('cuda'"):
        check_param_device("Block", "layer.weight", torch.device("cuda", 0), torch.device("cpu"))
    check_param_device("Block", "layer.weight", torch.device("cpu"), torch.device("cuda", 0))  # moved at init
    check_param_device("Block", "layer.weight", torch.device("meta"), torch.device("cpu"))  # materialized later


def _cuda_mesh_without_cuda():
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")
    return _raises(lambda: fully_shard(nn.Linear(4, 4), mesh=mesh))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_mesh_on_a_machine_without_cuda(dist):
    message = dist.run(1, _cuda_mesh_without_cuda)[0]
    assert "'cuda' mesh" in message and "init_device_mesh('cpu'" in message


class _IntParam(_Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Linear(2, 2)
        self.steps = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)


def _integer_parameter():
    return _raises(lambda: fully_shard(_IntParam()))


def test_non_floating_point_parameter(dist):
    message = dist.run(1, _integer_parameter)[0]
    assert "'steps'" in message and "torch.int64" in message and "ignored_params" in message


class _SplitDevices(_Module):
    def __init__(self):
        super().__init__()
        self.real = nn.Linear(2, 2)
        with torch.device("meta"):
            self.lazy = nn.Linear(2, 2)


def _parameters_on_different_devices():
    return _raises(lambda: fully_shard(_SplitDevices()))


def test_parameters_on_different_devices(dist):
    message = dist.run(1, _parameters_on_different_devices)[0]
    assert "'real.weight' on cpu" in message and "'lazy.weight' on meta" in message and "one device" in message


def _non_root_forward_first():
    model = shard_model(build_reference(), fully_shard)
    x = torch.randn(2, 8, SMALL.dim)
    return _raises(lambda: model.layers[0](x, model.rope_cos, model.rope_sin))


def test_non_root_forward_first(dist):
    message = dist.run(1, _non_root_forward_first)[0]
    assert "forward ran on" in message and "before its root 'Transformer'" in message


def test_shard_placement_fn_needs_shard_or_none_and_even_splits_past_dim0():
    import torch.distributed as torch_dist
    from torch.distributed.tensor import Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch_dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        with pytest.raises(ValueError, match="must return Shard"):
            fully_shard(nn.Linear(8, 8), shard_placement_fn=lambda p: Replicate())
        with pytest.raises(NotImplementedError, match="FSDP does not support uneven sharding on dim 1.*do not split evenly"):
            fully_shard(nn.Linear(6, 8), shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)
    finally:
        torch_dist.destroy_process_group()
