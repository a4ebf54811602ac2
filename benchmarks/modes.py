"""The ways to train the same model: ours (eager, compiled, fallback; compiled with passes off) and
PyTorch FSDP2's (eager, per-block compile, whole-model compile).

Every builder starts from the same seed, so every mode holds the same initial weights.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch
import torch.nn as nn

import fsdp_compile
from fsdp_compile.compile.backend import fsdp_inductor_with
from fsdp_compile.config import PassConfig
from benchmarks import hf_llama
from fsdp_compile.models import Transformer, TransformerConfig

__all__ = ["Mode", "build_mode", "build_model", "blocks", "COMPILED", "COMM_POLICY_MODES"]

# Ours with a CommPolicy (fsdp_compile.CommPolicy): what goes on the wire, eager and compiled.
_COMM_POLICIES = {
    "int8ag": fsdp_compile.CommPolicy(all_gather_dtype=torch.int8),
    "bf16rs": fsdp_compile.CommPolicy(reduce_wire_dtype=torch.bfloat16),
}
_MODE_COMM_POLICY = {f"ours-{kind}-{name}": policy for name, policy in _COMM_POLICIES.items() for kind in ("eager", "compiled")}
COMM_POLICY_MODES = tuple(_MODE_COMM_POLICY)
# Every fsdp_inductor mode's graph passes; the ablations turn some off (benchmarks/config.py).
_PASSES = {
    "ours-compiled": PassConfig(),
    "ours-compiled-bucket": PassConfig(reorder=False),
    "ours-compiled-nopasses": PassConfig(bucket=False, reorder=False),
    **{name: PassConfig() for name in COMM_POLICY_MODES if name.startswith("ours-compiled-")},
}
COMPILED = frozenset({"ours-fallback", "ours-compiled-regions", "ours-blockcompile", "torch-blockcompile", "torch-compiled", *_PASSES})


@dataclass
class Mode:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    # Entered around every step of this mode only, so a global switch never leaks into the others.
    step_context: Callable[[], ContextManager] = field(default=contextlib.nullcontext)
    # Host seconds of the last step's optimizer step and zero_grad (measure.train_step), the same
    # torch.optim code in every mode: what the step spends outside forward and backward.
    optimizer_s: float = 0.0

    @property
    def ours(self) -> bool:
        return self.name.startswith("ours-")


def _ours_policy(bf16: bool):
    if bf16:
        return fsdp_compile.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return fsdp_compile.MixedPrecisionPolicy()


def _torch_policy(bf16: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def build_model(config: TransformerConfig | hf_llama.HFLlamaConfig) -> nn.Module:
    """The model of ``config``: the benchmark's own Transformer, or the Hugging Face-shaped Llama."""
    if isinstance(config, hf_llama.HFLlamaConfig):
        return hf_llama.LlamaForCausalLM(config)
    return Transformer(config)


def blocks(model: nn.Module) -> nn.ModuleList:
    """The blocks each mode shards (then the root) and compiles: ``layers``, or HF's ``model.layers``."""
    return model.model.layers if isinstance(model, hf_llama.LlamaForCausalLM) else model.layers


# torchtitan's Llama plan: colwise q/k/v and gate/up, rowwise o and down.
_TP_PLAN = {
    "attention.wq": "colwise", "attention.wk": "colwise", "attention.wv": "colwise", "attention.wo": "rowwise",
    "feed_forward.w1": "colwise", "feed_forward.w3": "colwise", "feed_forward.w2": "rowwise",
}
_tp_meshes: dict[tuple[str, int], object] = {}


def _tensor_parallel(model: nn.Module, device: torch.device, tp: int):
    """Apply the TP plan to every block on the 'tp' dim of a (dp, tp) mesh; the 'dp' mesh fully_shard takes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    key = (device.type, tp)
    if key not in _tp_meshes:  # creating a mesh is collective: once per run, every mode shares it
        _tp_meshes[key] = init_device_mesh(device.type, (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))
    mesh = _tp_meshes[key]
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = hf_llama.TP_PLAN if isinstance(model, hf_llama.LlamaForCausalLM) else _TP_PLAN
    for block in blocks(model):
        parallelize_module(block, mesh["tp"], {name: styles[style]() for name, style in plan.items()})
    return mesh["dp"]


def _shard(model: nn.Module, fully_shard, policy, **kwargs) -> nn.Module:
    for block in blocks(model):
        fully_shard(block, mp_policy=policy, **kwargs)
    fully_shard(model, mp_policy=policy, **kwargs)
    return model


def _config_switch(name: str, value: object = True) -> Callable[[], ContextManager]:
    """A context that sets ``fsdp_compile.config.<name>`` to ``value`` while it is open."""

    @contextlib.contextmanager
    def switched():
        previous = getattr(fsdp_compile.config, name)
        setattr(fsdp_compile.config, name, value)
        try:
            yield
        finally:
            setattr(fsdp_compile.config, name, previous)

    return switched


def build_mode(
    name: str, config: TransformerConfig | hf_llama.HFLlamaConfig, device: torch.device, seed: int, lr: float, bf16: bool,
    tp: int = 1, foreach_adamw: bool = False,
) -> Mode:
    """One mode's model (same initial weights for every mode) and its AdamW (``foreach_adamw``: its foreach
    implementation, else torch's default for the device).

    Example::

        mode = build_mode("torch-eager", TransformerConfig(), torch.device("cpu"), seed=0, lr=1e-3, bf16=False)
    """
    torch.manual_seed(seed)
    model = build_model(config).to(device)  # initialized on CPU: the same weights on every device kind
    step_context: Callable[[], ContextManager] = contextlib.nullcontext
    runnable: nn.Module = model
    mesh = {"mesh": _tensor_parallel(model, device, tp)} if tp > 1 else {}
    if name.startswith("ours-"):
        comm_policy = _MODE_COMM_POLICY.get(name, fsdp_compile.CommPolicy())
        _shard(model, fsdp_compile.fully_shard, _ours_policy(bf16), comm_policy=comm_policy, **mesh)
        if name in _PASSES:
            # One backend object per mode: Dynamo would otherwise hand a later mode the graph (and
            # passes) compiled for an earlier one, the model class being the same.
            runnable = torch.compile(model, backend=fsdp_inductor_with(_PASSES[name]))
        elif name == "ours-compiled-regions":
            # The whole model as one graph, a nested compile region per block
            # (fsdp_compile.config.block_compile = "regions" only during this mode's steps); its own
            # backend object, as for the modes above.
            step_context = _config_switch("block_compile", "regions")
            runnable = torch.compile(model, backend=fsdp_inductor_with(PassConfig()))
        elif name == "ours-blockcompile":
            # torchtitan's per-block recipe on ours: each block's forward compiled alone, the eager
            # hooks around it (FSDPModule.compile); identical blocks share one graph.
            for block in blocks(model):
                block.compile(backend="fsdp_inductor")
        elif name == "ours-fallback":
            # The FSDP hooks run eagerly between compiled regions; the flag is on only during this mode's steps.
            step_context = _config_switch("skip_fsdp_hooks")
            runnable = torch.compile(model, backend="inductor")
    elif name in ("torch-eager", "torch-blockcompile", "torch-compiled"):
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        if name == "torch-blockcompile":
            # torchtitan's apply_compile: compile each block (fullgraph) before fully_shard, so FSDP2's
            # hooks sit on the compiled module and run eagerly around each block's graph.
            layers = blocks(model)
            for index, block in layers.named_children():
                layers.register_module(index, torch.compile(block, fullgraph=True))
        _shard(model, torch_fully_shard, _torch_policy(bf16), **mesh)
        if name == "torch-compiled":
            # torch.compile on the whole FSDP2 model. FSDP2's hooks are torch.compiler.disable'd:
            # Dynamo breaks the graph at each one, and each block's forward compiles as a frame of
            # its own with the hooks (and all collectives) eager around it.
            runnable = torch.compile(model, backend="inductor")
    else:
        raise ValueError(f"unknown mode {name!r}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True if foreach_adamw else None)
    return Mode(name, runnable, optimizer, step_context)
