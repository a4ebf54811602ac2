"""fsdp_compile: fully sharded data parallel training whose eager runtime and torch.compile path are one system.

Example::

    from fsdp_compile import fully_shard, MixedPrecisionPolicy
    for block in model.layers:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model)
"""
from fsdp_compile import config
from fsdp_compile.api import (
    BackwardPrefetch,
    CommPolicy,
    CPUOffload,
    CPUOffloadPolicy,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from fsdp_compile.fsdp1 import fsdp1_kwargs
from fsdp_compile.runtime.collectives import CollectiveRecord, record_collectives
from fsdp_compile.runtime.mesh import DataParallelMeshDims
from fsdp_compile.module import FSDPModule, fully_shard, register_fsdp_forward_method, share_comm_ctx
from fsdp_compile.runtime.param_group import TrainingState, UnshardHandle
from fsdp_compile.optimizer_state_dict import optim_state_dict, optim_state_dict_to_load, rekey_optim_state_dict
from fsdp_compile.runtime.param import ShardedState
from fsdp_compile.runtime.state_dict import get_state_dict_type, state_dict_type
from fsdp_compile.runtime.unshard_params import unshard_params

__all__ = [
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "FSDPModule",
    "UnshardHandle",
    "MixedPrecisionPolicy",
    "CommPolicy",
    "OffloadPolicy",
    "DataParallelMeshDims",
    "CPUOffloadPolicy",
    "TrainingState",
    "ShardedState",
    "record_collectives",
    "CollectiveRecord",
    "config",
    "state_dict_type",
    "get_state_dict_type",
    "unshard_params",
    "StateDictType",
    "StateDictConfig",
    "FullStateDictConfig",
    "LocalStateDictConfig",
    "ShardedStateDictConfig",
    "StateDictSettings",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "rekey_optim_state_dict",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "OptimStateKeyType",
    "ShardingStrategy",
    "BackwardPrefetch",
    "MixedPrecision",
    "CPUOffload",
    "fsdp1_kwargs",
]


def _find_checkout_passes() -> None:
    # passes/ lives beside fsdp_compile/ in a source checkout (docs/design.md section 2); an install maps
    # it to fsdp_compile.passes. Running from a checkout (PYTHONPATH=.) gets the same import name.
    import importlib.util
    import os
    import sys

    if "fsdp_compile.passes" in sys.modules or importlib.util.find_spec("fsdp_compile.passes") is not None:
        return
    passes_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "passes")
    init_file = os.path.join(passes_dir, "__init__.py")
    if os.path.isfile(init_file):
        spec = importlib.util.spec_from_file_location("fsdp_compile.passes", init_file, submodule_search_locations=[passes_dir])
        module = importlib.util.module_from_spec(spec)
        sys.modules["fsdp_compile.passes"] = module
        spec.loader.exec_module(module)


_find_checkout_passes()

from fsdp_compile.compile import backend as _backend  # noqa: E402,F401  registers backend="fsdp_inductor"
