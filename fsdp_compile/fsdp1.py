"""FSDP1's configurations as ``fully_shard`` arguments: ``fsdp1_kwargs`` maps a sharding strategy
(with FSDP1's mixed precision and CPU offload) onto a mesh and policies ([Note: FSDP1 names are
mappings, not a second runtime] in api.py). Above the runtime: the default meshes are its own."""
from __future__ import annotations

from typing import Any

from fsdp_compile.api import CPUOffload, MixedPrecision, ShardingStrategy
from fsdp_compile.runtime.mesh import default_mesh, hybrid_mesh, replicate_mesh

__all__ = ["fsdp1_kwargs"]


def fsdp1_kwargs(
    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
    *,
    mixed_precision: MixedPrecision | None = None,
    cpu_offload: CPUOffload | None = None,
    device_mesh: Any = None,
) -> dict[str, Any]:
    """The ``fully_shard`` keyword arguments that reproduce an FSDP1 configuration.

    ``device_mesh``: for ``FULL_SHARD``/``SHARD_GRAD_OP`` a 1-D mesh (default: all ranks); for the
    hybrid strategies a 2-D ``(replicate, shard)`` mesh (default: shard over the ranks of one node,
    ``LOCAL_WORLD_SIZE`` or the CUDA device count); ``NO_SHARD`` builds ``(world, 1)`` itself.

    Example::

        kwargs = fsdp1_kwargs(ShardingStrategy.SHARD_GRAD_OP,
                              mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
        for block in model.layers:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        model.set_backward_prefetch(BackwardPrefetch.BACKWARD_POST)
    """
    kwargs: dict[str, Any] = {}
    if sharding_strategy == ShardingStrategy.NO_SHARD:
        kwargs["mesh"] = device_mesh if device_mesh is not None else replicate_mesh()
        kwargs["reshard_after_forward"] = False  # one-rank shards: re-gathering would only copy
    elif sharding_strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        kwargs["mesh"] = device_mesh if device_mesh is not None else hybrid_mesh()
        if kwargs["mesh"].ndim != 2:
            raise ValueError(f"{sharding_strategy.name} needs a 2-D (replicate, shard) device_mesh, got {kwargs['mesh'].ndim}-D")
        kwargs["reshard_after_forward"] = sharding_strategy == ShardingStrategy.HYBRID_SHARD
    elif sharding_strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        kwargs["mesh"] = device_mesh if device_mesh is not None else default_mesh()
        kwargs["reshard_after_forward"] = sharding_strategy == ShardingStrategy.FULL_SHARD
    else:
        raise ValueError(f"unknown sharding_strategy {sharding_strategy!r}; pass a ShardingStrategy member")
    if mixed_precision is not None:
        kwargs["mp_policy"] = mixed_precision.to_policy()
    if cpu_offload is not None:
        kwargs["offload_policy"] = cpu_offload.to_policy()
    return kwargs
