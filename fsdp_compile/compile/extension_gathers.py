"""A block frame's all-gather where its group has FSDP2's all-gather extensions: the runtime runs them
and hands the graph plain gathered rows ([Note: all-gather extensions under a whole-model compile] in
policy.py; docs/design.md section 5.4). ``frames.py`` calls it from ``fsdp_compile::frame_all_gather``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fsdp_compile.compile.policy import KEPT_GATHER_LOSES_THE_EXTENSION, all_gather_extension_refused
from fsdp_compile.kernels import ops

if TYPE_CHECKING:
    from fsdp_compile.runtime.param import FSDPParam

__all__ = ["gather_through_extensions"]


def gather_through_extensions(
    block: Any, indices: tuple[int, ...], padded_numels: list[int], param_dtype: torch.dtype, shard_size: int,
    device: torch.device, backward: bool,
) -> torch.Tensor:
    """What ``frame_all_gather`` returns for ``block`` (frames.py's ``BlockFrame``, not imported: frames.py
    imports this module), whose group has an all-gather extension: the group gathered as its eager unshard
    gathers it (the extensions run), the parameters ``indices`` laid out as the flat ``[shard_size,
    sum(padded_numels)]`` all-gather output the graph's copy-out reads, in ``param_dtype``, complete (the
    graph's wait on it is a no-op). Then issues the next block's all-gather, as any frame op does."""
    group = block.state.group
    assert group is not None
    if not group.reshard_after_backward:  # set after the graph was admitted, which never reads it
        raise NotImplementedError(all_gather_extension_refused(
            next(p.fqn for p in group.fsdp_params if p.uses_all_gather_extension), KEPT_GATHER_LOSES_THE_EXTENSION, group.label,
        ))
    gather = block.gathers[backward]
    gather.pending, gather.learned = False, None
    gather.drop()  # a plain all-gather issued ahead before the extension was set: never this block's

    def lay_out(fsdp_params: "list[FSDPParam]") -> torch.Tensor:
        chosen = [fsdp_params[index] for index in indices]
        unsharded = [_plain_unsharded(fsdp_param, param_dtype, group.label) for fsdp_param in chosen]
        rows = torch.empty((shard_size, sum(padded_numels)), dtype=param_dtype, device=device)
        with torch.no_grad():
            # The inverse of the graph's copy-out: the reduce-scatter copy-in's layout, undivided.
            ops.reduce_scatter_copy_in(
                # A parameter sharded on a dim > 0 is a moved-dim view here; the copy-in takes contiguous inputs.
                [p.layout.to_dim0(value).contiguous() for p, value in zip(chosen, unsharded)], list(padded_numels), rows, 1.0,
            )
        return rows.view(-1)

    gathered = group.read_gathered(lay_out, "block-frame-backward" if backward else "block-frame-forward")
    block.gather_next_ahead(backward)
    return gathered


def _plain_unsharded(fsdp_param: "FSDPParam", param_dtype: torch.dtype, label: str) -> torch.Tensor:
    """``fsdp_param``'s unsharded parameter as fsdp_post_all_gather built it, where the graph can take it:
    a plain tensor in the dtype the graph was traced with. Refused otherwise, on every rank alike (each
    runs the same extension), before the graph computes on it."""
    value = fsdp_param.unsharded_param
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        why = (
            f"its fsdp_post_all_gather returned a {type(value).__name__}, a tensor subclass (torchao's float8 weights return "
            "one), where a block frame's graph takes the gathered parameter from the runtime as a plain tensor and was "
            "traced to compute on that"
        )
    elif value.dtype != param_dtype:
        why = (
            f"its fsdp_post_all_gather returned {value.dtype} where the graph was traced for the parameter dtype "
            f"{param_dtype}; return param_dtype, as FSDP2 expects"
        )
    else:
        return value
    raise NotImplementedError(all_gather_extension_refused(fsdp_param.fqn, why, label))
