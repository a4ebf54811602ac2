"""An optimizer must hold the sharded parameters, which receive the gradients. One built before
``fully_shard`` holds the parameters ``fully_shard`` replaced by their shards; one built while a
module's parameters were gathered holds their unsharded copies (``model.parameters()`` returns what
the module registers: after a forward without backward, under ``no_grad`` or ``inference_mode``,
the root keeps its parameters gathered, as FSDP2 does). Either way its ``step()`` would update
tensors that get no gradient, and those parameters would not train (PyTorch FSDP2 lets both
happen without a word).

``fully_shard`` marks every parameter it replaces (and ``replace_sharded_param`` every shard it
replaces), and each unsharded copy is marked when made; one global optimizer step pre-hook refuses
an optimizer holding a marked parameter, at its first ``step()``. The check runs once per optimizer
and parameter count, so a step costs one weak-dictionary lookup.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["mark_replaced", "mark_unsharded", "install_optimizer_check"]

_REPLACED_ATTR = "_fsdp_compile_replaced_by"
# Set on an optimizer: how many parameters it held when last checked (checked again when that changes).
_CHECKED_COUNT_ATTR = "_fsdp_compile_checked_params"


def mark_replaced(param: torch.Tensor, where: str) -> None:
    """``param`` is no longer what the module holds; ``where`` says what replaced it, for the error."""
    setattr(param, _REPLACED_ATTR, f"a parameter that {where} replaced")


def mark_unsharded(param: torch.Tensor, fqn: str) -> None:
    """``param`` is the unsharded copy of ``fqn``, registered on its module only while gathered."""
    setattr(
        param, _REPLACED_ATTR,
        f"the unsharded copy of '{fqn}' (the module registers it only while gathered; a forward without backward, "
        "under no_grad or inference_mode, leaves the root's parameters gathered)",
    )


def _refuse_replaced_parameters(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if torch.compiler.is_compiling():
        return
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if getattr(optimizer, _CHECKED_COUNT_ATTR, None) == count:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            where = getattr(param, _REPLACED_ATTR, None)
            if where is not None:
                raise RuntimeError(
                    f"fsdp_compile: {type(optimizer).__name__}.step() would update {where}, so it would train nothing. "
                    "Build the optimizer after fully_shard (and after assigning parameters), from model.parameters(), "
                    "while the model is sharded (before its first forward, after a backward, or after model.reshard()), "
                    "so it holds the sharded parameters."
                )
    setattr(optimizer, _CHECKED_COUNT_ATTR, count)


@functools.cache
def install_optimizer_check() -> None:
    """Once per process, at the first ``fully_shard``."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_refuse_replaced_parameters)
