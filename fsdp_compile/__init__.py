"""fsdp_compile: fully sharded data parallel training whose eager runtime and torch.compile path are one system.

Example::

    from fsdp_compile import fully_shard, MixedPrecisionPolicy
    for block in model.layers:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model)
"""
from fsdp_compile import config
from fsdp_compile.api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fsdp_compile.collectives import CollectiveRecord, record_collectives
from fsdp_compile.module import FSDPModule, UnshardHandle, fully_shard
from fsdp_compile.param_group import TrainingState
from fsdp_compile.param import ShardedState

__all__ = [
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "TrainingState",
    "ShardedState",
    "record_collectives",
    "CollectiveRecord",
    "config",
]
