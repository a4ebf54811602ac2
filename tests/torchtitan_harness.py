"""What torchtitan's trainer needs to train its llama3 debug recipe on CPU ranks, for the tests.

torchtitan (0.3.0) trains on GPUs; this harness supplies what a CPU test machine lacks, and none
of it is fsdp_compile's: the same harness runs the recipe on PyTorch's FSDP2 and on ours.

- Device: ``torchtitan.tools.utils`` picks ``cuda`` when no accelerator is present; every
  torchtitan module that imported ``device_type`` / ``device_module`` gets ``cpu`` and a CPU
  stand-in for the memory and device queries instead, and ``get_local_device`` returns the CPU.
- Process group: the ranks' gloo group is in place before the trainer starts, so its
  ``init_distributed`` keeps it (it skips an initialized group).
- Reduction: FSDP2 reduces torchtitan's undivided gradients by NCCL's ``PREMUL_SUM``, which gloo
  lacks; the harness asks every FSDP module for a plain SUM (``_sum_reduction``).
- Parallelism backend: ``--parallelism.spmd_backend partial_dtensor`` (DTensor parameters);
  torchtitan's default ``spmd_types`` annotates plain parameters, which torch 2.13's FSDP2 and
  fsdp_compile alike refuse in ``fully_shard``.
- Timeouts: torchtitan shortens the group's timeout after the first step by
  ``torch.distributed.set_timeout``, newer than torch 2.13; the ranks keep their group's.
- Attention: the recipe's FlexAttention is compiled by torchtitan with Inductor, which has no
  FlexAttention backward on CPU. Its attention call is replaced by ``scaled_dot_product_attention``
  with the same mask made dense (the recipe's causal, per-document mask), and the mask is built by
  ``create_block_mask`` uncompiled. With no flex kernel left, torchtitan's check that a flex model
  compiles with inductor or aot_eager only is lifted (``--compile.backend fsdp_inductor``).
- Metrics: the trainer's ``metrics_processor.log`` is replaced by a recorder of each step's
  global loss and gradient norm (the values torchtitan logs); its device memory figures mean
  nothing on CPU.
- Data and tokenizer: the recipe's ``c4_test`` set (JSON lines, a ``text`` field) is written here
  from a fixed seed, and a byte-level tokenizer (256 bytes and the two special tokens) is built
  with ``tokenizers``, so the test needs no assets.

``use_fsdp_compile()`` swaps the names torchtitan's ``torchtitan.distributed.fsdp`` imports for
fsdp_compile's, as a user does (README). torchtitan's chunked loss checks its ``lm_head`` against
PyTorch's ``FSDPModule`` (imported in the call) to keep it unsharded across the loss chunks and
reduce its gradient once; on fsdp_compile that check is false and the chunks run without those
calls (the eager losses and gradient norms are still bitwise FSDP2's).
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import time
import types
from typing import Any, Iterator

import torch

RECIPE = ("--module", "llama3", "--config", "llama3_debugmodel")


class _CPUDeviceModule(types.ModuleType):
    """``torch.cpu`` with the queries torchtitan asks of ``torch.cuda`` (its memory monitor)."""

    def __init__(self) -> None:
        super().__init__("torchtitan_cpu_device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def set_device(self, device: Any) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def get_device_properties(self, device: Any = None) -> Any:
        return types.SimpleNamespace(name="cpu", total_memory=1 << 30)

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return {}

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass


def _dense_masked_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    """FlexAttention's call as SDPA with the block mask's ``mask_mod`` made dense (B, 1, L, S)."""
    assert score_mod is None, "the harness's attention takes no score_mod"
    batch, _, q_len, _ = q.shape
    kv_len = k.shape[2]
    b = torch.arange(batch, device=q.device).view(batch, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=q.device)
    q_idx = torch.arange(q_len, device=q.device).view(1, 1, q_len, 1)
    kv_idx = torch.arange(kv_len, device=q.device).view(1, 1, 1, kv_len)
    mask = block_mask.mask_mod(b, h, q_idx, kv_idx).expand(batch, 1, q_len, kv_len)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )
    assert not return_aux.lse, "the harness's attention returns no log-sum-exp"
    return out, None  # no aux: the recipe asks for no log-sum-exp


def _patch_torchtitan_for_cpu() -> None:
    import torchtitan.tools.utils as tt_utils

    cpu_module = _CPUDeviceModule()
    tt_utils.device_type, tt_utils.device_module = "cpu", cpu_module
    tt_utils.get_local_device = lambda: torch.device("cpu")
    # The modules that bind the names at import: import them now, then rebind.
    import torchtitan.trainer  # noqa: F401
    import torchtitan.models.common.decoder as decoder
    from torchtitan.models.common.attention import FlexAttention
    from torch.nn.attention.flex_attention import create_block_mask

    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan") and module is not None:
            if getattr(module, "device_type", None) == "cuda":
                module.device_type = "cpu"
            if getattr(module, "device_module", None) is not None and module is not tt_utils:
                module.device_module = cpu_module
            if hasattr(module, "get_local_device") and module is not tt_utils:
                module.get_local_device = tt_utils.get_local_device
    FlexAttention.compiled_flex_attn = staticmethod(_dense_masked_attention)
    decoder.create_attention_mask = create_block_mask
    # With no FlexAttention kernel left, no flex region needs Inductor: any backend compiles the
    # blocks (torchtitan refuses a backend other than inductor / aot_eager for a flex model).
    import torchtitan.distributed.compile as tt_compile

    tt_compile._maybe_regional_inductor_backend = lambda model, backend: backend
    import torchtitan.distributed.fsdp as tt_fsdp
    import torchtitan.distributed.utils as tt_dist_utils

    # After the first step torchtitan shortens the groups' timeouts by torch.distributed.set_timeout,
    # which torch 2.13 lacks; the test's ranks keep the timeout of the pool's group.
    tt_dist_utils.set_pg_timeouts = lambda timeout, parallel_dims=None: None
    if not getattr(tt_fsdp.disable_fsdp_gradient_division, "_sums_on_gloo", False):
        tt_fsdp.disable_fsdp_gradient_division = _sum_reduction(tt_fsdp.disable_fsdp_gradient_division)


def _sum_reduction(disable_fsdp_gradient_division):
    """torchtitan turns FSDP's gradient division off (factor 1), which FSDP2 does by NCCL's
    ``PREMUL_SUM``; gloo has only ``SUM``, so every FSDP module reduces by SUM (FSDP2's
    ``set_force_sum_reduction_for_comms``; fsdp_compile always does)."""
    import torchtitan.distributed.fsdp as tt_fsdp

    def disable_and_sum(model):
        disable_fsdp_gradient_division(model)
        for module in model.modules():
            if isinstance(module, tt_fsdp.FSDPModule):  # the name use_fsdp_compile swaps
                module.set_force_sum_reduction_for_comms(True)

    disable_and_sum._sums_on_gloo = True
    return disable_and_sum


def write_assets(folder: str, documents: int = 64) -> tuple[str, str]:
    """A byte-level tokenizer and a c4_test-format data set under ``folder``: (tokenizer dir, data dir)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer_dir = os.path.join(folder, "tokenizer")
    data_dir = os.path.join(folder, "c4_test")
    os.makedirs(tokenizer_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    tokenizer.save(os.path.join(tokenizer_dir, "tokenizer.json"))
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, f)
    words = "the of and to in a is that for it as was with be by on not he this are or his from at".split()
    rng = random.Random(0)
    with open(os.path.join(data_dir, "data.json"), "w") as f:
        for _ in range(documents):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(5, 40)))
            record = {"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": "https://example.com"}
            f.write(json.dumps(record) + "\n")
    return tokenizer_dir, data_dir


@contextlib.contextmanager
def use_fsdp_compile() -> Iterator[None]:
    """torchtitan on fsdp_compile: the names its FSDP module imports, replaced by ours."""
    import torchtitan.distributed.fsdp as tt_fsdp

    import fsdp_compile

    names = ("fully_shard", "MixedPrecisionPolicy", "CPUOffloadPolicy", "FSDPModule")
    saved = {name: getattr(tt_fsdp, name) for name in names}
    for name in names:
        setattr(tt_fsdp, name, getattr(fsdp_compile, name))
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(tt_fsdp, name, value)


def _assert_sharded_by(model: torch.nn.Module, fsdp: str) -> None:
    import fsdp_compile
    from torch.distributed.fsdp import FSDPModule

    expected, other = (fsdp_compile.FSDPModule, FSDPModule)
    if fsdp != "fsdp_compile":
        expected, other = other, expected
    sharded = [model, *model.layers.values()]
    assert all(isinstance(m, expected) and not isinstance(m, other) for m in sharded), f"not all sharded by {fsdp}"


def train(
    work_dir: str, *, fsdp: str, steps: int, extra_args: tuple[str, ...] = (), compile_root: str | None = None
) -> dict[str, Any]:
    """Run the recipe for ``steps`` steps on this rank: ``steps``, each step's (global mean loss,
    grad norm); ``build_s`` and ``train_s``, the seconds ``config.build()`` and ``train()`` took."""
    os.environ.setdefault("LOCAL_RANK", str(torch.distributed.get_rank()))
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(work_dir, "hf_cache"))
    _patch_torchtitan_for_cpu()
    from torchtitan.config import ConfigManager

    tokenizer_dir, data_dir = os.path.join(work_dir, "tokenizer"), os.path.join(work_dir, "c4_test")
    args = [
        *RECIPE,
        "--hf_assets_path", tokenizer_dir,
        "--dataloader.dataset_path", data_dir,
        "--dump_folder", os.path.join(work_dir, f"dump_{fsdp}"),
        "--training.steps", str(steps),
        "--training.local_batch_size", "1",
        "--training.seq_len", "32",
        "--parallelism.data_parallel_shard_degree", str(torch.distributed.get_world_size()),
        "--parallelism.spmd_backend", "partial_dtensor",
        "--validator.no-enable",
        "--debug.seed", "0",
        *extra_args,
    ]
    config = ConfigManager().parse_args(args)
    torch._dynamo.reset()
    with use_fsdp_compile() if fsdp == "fsdp_compile" else contextlib.nullcontext():
        start = time.perf_counter()
        trainer = config.build()
        _assert_sharded_by(trainer.model_parts[0], fsdp)
        if compile_root is not None:
            trainer.model_parts[0].compile(backend=compile_root)
        steps_seen: list[tuple[float, float]] = []

        def record(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
            steps_seen.append((float(global_avg_loss), float(grad_norm)))

        trainer.metrics_processor.log = record
        built = time.perf_counter()
        try:
            trainer.train()
        finally:
            trainer.close()
    return {"steps": steps_seen, "build_s": built - start, "train_s": time.perf_counter() - built}
