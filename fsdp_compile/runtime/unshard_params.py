"""``unshard_params``: full parameters on the modules for a while (FSDP1's ``summon_full_params``)."""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_compile.runtime.collectives import gather_full
from fsdp_compile.runtime.param import FSDPParam
from fsdp_compile.runtime.state import FSDPState, all_states_under, state_of

__all__ = ["unshard_params"]


def _gather(local: torch.Tensor, fsdp_param: FSDPParam, reason: str) -> torch.Tensor:
    """The full (global) tensor: the shards gathered over dp, then the pieces over tensor parallel."""
    piece = gather_full(local, fsdp_param.layout, fsdp_param.mesh_info, fsdp_param.device, fsdp_param.fqn, reason)
    return fsdp_param.full_of_piece(piece)


@contextlib.contextmanager
def unshard_params(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Expose full parameters as plain tensors on the module (FSDP1's ``summon_full_params``).

    Collective: every rank must enter. Inside, ``module.<name>`` is a full ``nn.Parameter`` in the
    parameter's own dtype (not ``param_dtype``); on exit the sharded ``DTensor`` parameters return.

    Args:
        recurse: also the ``fully_shard`` modules nested in ``module`` (else only ``module``'s own group).
        writeback: copy in-place edits of the full parameters (and of their ``.grad`` with
            ``with_grads``) back into the shards on exit.
        rank0_only: only rank 0 sees full parameters; the others keep the sharded ones.
            Incompatible with ``writeback``.
        offload_to_cpu: the full parameters are CPU tensors (pair with ``rank0_only`` to keep
            one copy per machine).
        with_grads: the full parameters' ``.grad`` is the all-gathered sharded gradient.

    Example::

        with fsdp_compile.unshard_params(model):
            model.head.weight.mul_(0.5)         # written back into each rank's shard
        with fsdp_compile.unshard_params(model, writeback=False, rank0_only=True):
            if dist.get_rank() == 0:
                print(model.head.weight.norm())
    """
    states = all_states_under([module]) if recurse else [s for s in [state_of(module)] if s is not None]
    if not states:
        raise ValueError(
            f"unshard_params: no fully_shard module in this {type(module).__name__}"
            + ("" if recurse else " (recurse=False takes the fully_shard module itself)")
        )
    _check_unshard_params_args(states, writeback, rank0_only, offload_to_cpu, with_grads)
    for state in states:
        if state.summoned:
            raise RuntimeError(
                f"fsdp_compile: unshard_params() entered for '{state.label}' inside another unshard_params() that "
                "already exposes it; nesting is not supported. Use one context around the code that needs them."
            )
    for state in states:
        state.reshard_for("unshard_params()")
    exposed: list[tuple[FSDPParam, nn.Parameter]] = []
    show = not rank0_only or dist.get_rank() == 0
    for state in states:
        state.summoned = True
    try:
        for state in states:
            if state.group is None:
                continue
            for fsdp_param in state.group.fsdp_params:
                full, grad = _gather_param_and_grad(fsdp_param, with_grads)
                if not show:
                    continue
                if offload_to_cpu:
                    full = full.cpu()
                full_param = nn.Parameter(full, requires_grad=fsdp_param.sharded_param.requires_grad)
                full_param.grad = grad
                fsdp_param.register_everywhere(full_param)  # tied names share one full tensor
                exposed.append((fsdp_param, full_param))
        yield
    finally:
        try:
            if writeback:
                for fsdp_param, _ in exposed:
                    _write_back(fsdp_param, with_grads)
        finally:
            for fsdp_param, _ in exposed:
                fsdp_param.register_everywhere(fsdp_param.sharded_param)
            for state in states:
                state.summoned = False


def _check_unshard_params_args(states: list[FSDPState], writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool) -> None:
    """FSDP1's summon_full_params argument rules, with the fix in each message."""
    if with_grads and offload_to_cpu:
        raise NotImplementedError(
            "unshard_params(with_grads=True, offload_to_cpu=True) is not supported: gradients stay on the device. "
            "Use offload_to_cpu=False with with_grads=True, or read the gradients in a second context."
        )
    one_rank = [s.label for s in states if s.group is not None and s.group.mesh_info.shard_size == 1]
    if offload_to_cpu and one_rank:
        raise NotImplementedError(
            f"unshard_params(offload_to_cpu=True) on groups sharded over one rank (NO_SHARD-like: {one_rank}) is not "
            "supported: their parameters are already full. Use offload_to_cpu=False and copy what you need to CPU."
        )
    if writeback and rank0_only:
        raise NotImplementedError(
            "unshard_params(writeback=True, rank0_only=True) is not supported: the other ranks never see the edits. "
            "Pass writeback=False with rank0_only=True, or rank0_only=False to edit on every rank."
        )
    if with_grads:
        for state in states:
            if state.group is not None and any(p.unsharded_accumulated_grad is not None for p in state.group.fsdp_params):
                raise NotImplementedError(
                    f"unshard_params(with_grads=True): '{state.label}' holds gradients accumulated without sync "
                    "(set_requires_gradient_sync(False)); run a backward with gradient sync first."
                )
    if offload_to_cpu and not rank0_only:
        warnings.warn(
            "unshard_params(offload_to_cpu=True, rank0_only=False) copies the full parameters to CPU on every rank, "
            "which may run a machine out of CPU memory; prefer rank0_only=True with offload_to_cpu=True.",
            stacklevel=3,
        )


def _gather_param_and_grad(fsdp_param: FSDPParam, with_grads: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    full = _gather(fsdp_param.local_shard(), fsdp_param, "unshard_params")
    sharded_grad = fsdp_param.sharded_param.grad
    if not with_grads or sharded_grad is None:
        return full, None
    return full, _gather(sharded_grad._local_tensor, fsdp_param, "unshard_params-grad")


def _write_back(fsdp_param: FSDPParam, with_grads: bool) -> None:
    """Copy this rank's rows of the (possibly edited or reassigned) full parameter into its shard."""
    full = fsdp_param.registered_value()
    if full is None or tuple(full.shape) != tuple(fsdp_param.orig_size):
        raise RuntimeError(
            f"fsdp_compile: unshard_params(writeback=True): '{fsdp_param.fqn}' was replaced by a tensor of shape "
            f"{None if full is None else tuple(full.shape)}; the shard needs shape {tuple(fsdp_param.orig_size)}. "
            "Edit parameters in place (e.g. param.copy_(...)) inside the context."
        )
    with torch.no_grad():
        local = fsdp_param.local_shard()
        local.copy_(fsdp_param.shard_of_full(full.detach()))
        if with_grads and full.grad is not None:
            grad_rows = fsdp_param.shard_of_full(full.grad.detach())
            sharded_grad = fsdp_param.sharded_param.grad
            if sharded_grad is None:
                fsdp_param.set_sharded_grad(grad_rows.to(local.dtype).clone())
            else:
                sharded_grad._local_tensor.copy_(grad_rows)
