"""What one benchmark run does: the model, the data, the modes and where results go.

``BenchConfig`` is frozen and picklable: it travels unchanged to every spawned rank.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from benchmarks.hf_llama import HFLlamaConfig
from benchmarks.modes import COMM_POLICY_MODES
from fsdp_compile.models import TransformerConfig

__all__ = ["MODES", "MODELS", "PASS_ABLATION_MODES", "SCALING_MODES", "SCALING_LAYERS", "BenchConfig", "parse_args"]

# --model: the benchmark's own Llama-style decoder (fsdp_compile/models.py: blocks called as
# block(x, cos, sin), a tensor back) or one shaped like Hugging Face's LlamaForCausalLM
# (benchmarks/hf_llama.py: keyword arguments, a (cos, sin) tuple and a mask into every block, a
# tuple back, grouped-query attention).
MODELS = ("transformer", "hf-llama")

# Table order. torch-eager is the baseline of the speed ratio; ours-eager of the loss agreement.
MODES = ("ours-eager", "ours-compiled", "ours-fallback", "torch-eager", "torch-blockcompile")
# ours-compiled with some graph passes off, for a before/after-passes table from one run
# (--pass-ablation adds them; --modes may name them).
PASS_ABLATION_MODES = ("ours-compiled-bucket", "ours-compiled-nopasses")
# --compile-scaling: the four ways users compile our FSDP model (whole model, each block a frame of its
# own (the default) or a nested region of one graph; per block; whole model with the hooks eager) and
# PyTorch's two (per block, whole model).
SCALING_MODES = (
    "ours-compiled", "ours-compiled-regions", "ours-blockcompile", "ours-fallback", "torch-blockcompile", "torch-compiled",
)
SCALING_LAYERS = (2, 8, 16, 32)
BASELINE_SPEED = "torch-eager"
BASELINE_LOSS = "ours-eager"


@dataclass(frozen=True)
class BenchConfig:
    # Defaults finish in about 3 minutes on 2 CPU cores (2 gloo ranks), compile time included.
    modes: tuple[str, ...] = MODES
    world_size: int = 2
    device: str = "auto"
    dim: int = 256
    layers: int = 2
    heads: int = 4
    vocab: int = 2048
    seq: int = 256
    batch: int = 4
    untied: bool = False
    bf16: bool = False
    model: str = "transformer"  # one of MODELS
    kv_heads: int | None = None  # hf-llama's key-value heads; None: heads // 2 (grouped-query attention)
    tp: int = 1  # tensor-parallel ways: a (world / tp, tp) = (dp, tp) mesh, torchtitan's TP plan per block
    steps: int = 15
    warmup: int = 2
    seed: int = 0
    lr: float = 1e-3
    foreach_adamw: bool = False  # AdamW(foreach=True): torch's default on CUDA, where the shards are DTensors
    warm_compile: bool = True
    fresh_inductor_cache: bool = True
    inductor_cache_dir: str | None = None  # kept per rank under this folder (--compile-scaling's warm runs)
    compile_scaling: tuple[int, ...] | None = None  # layer counts of --compile-scaling
    overhead: bool = False  # --overhead: the section is the host-overhead one
    shallow_layers: int | None = None  # a second depth per mode, for host time per block (benchmarks/overhead.py)
    profile_step: bool = False  # one cProfile'd and one torch.profiler'd step of each of ours
    threads: int | None = None  # intra-op threads per rank on CPU; None: the cores / ranks
    out_dir: str = "bench_out"
    results_md: str | None = None
    command: str = ""

    def model_config(self, layers: int | None = None) -> TransformerConfig | HFLlamaConfig:
        """The model; ``layers`` overrides --layers (the shallow twins of --shallow-layers)."""
        if self.model == "hf-llama":
            return HFLlamaConfig(
                vocab_size=self.vocab, hidden_size=self.dim, num_hidden_layers=self.layers if layers is None else layers,
                num_attention_heads=self.heads, num_key_value_heads=self.key_value_heads,
                max_position_embeddings=self.seq, tie_word_embeddings=not self.untied,
            )
        return TransformerConfig(
            vocab_size=self.vocab, dim=self.dim, n_layers=self.layers if layers is None else layers, n_heads=self.heads,
            max_seq_len=self.seq, tie_embeddings=not self.untied,
        )

    @property
    def key_value_heads(self) -> int:
        """hf-llama's key-value heads (--kv-heads, else half the heads: grouped-query attention)."""
        return self.kv_heads if self.kv_heads is not None else max(1, self.heads // 2)

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps


_EPILOG = """\
modes (all run in one process per rank, interleaved step by step: A B C A B C ...):
  ours-eager          fsdp_compile.fully_shard per block + root, eager
  ours-compiled       the same, then torch.compile(model, backend="fsdp_inductor"): each block compiled
                      as a frame of its own, one graph for identical blocks
  ours-fallback       the same, fsdp_compile.config.skip_fsdp_hooks = True around each step,
                      torch.compile(model, backend="inductor")
  ours-compiled-regions  ours-compiled with fsdp_compile.config.block_compile = "regions" around
                      each step: the whole model one graph, a nested compile region per block (not in
                      the default set)
  ours-blockcompile   fsdp_compile.fully_shard per block + root, block.compile(backend="fsdp_inductor")
                      per block (torchtitan's recipe; not in the default set)
  torch-eager         torch.distributed.fsdp.fully_shard per block + root, eager
  torch-blockcompile  torch.compile(block, fullgraph=True) per block, then PyTorch's
                      fully_shard per block + root (torchtitan's default)
  torch-compiled      PyTorch's fully_shard per block + root, then torch.compile(model): Dynamo
                      breaks the graph at FSDP2's hooks and compiles each block's forward as a
                      frame of its own, the hooks eager around it (not in the default set)
  with --pass-ablation, also:
  ours-compiled-bucket    ours-compiled with PassConfig(reorder=False): one collective per
                          group, each waited on at once
  ours-compiled-nopasses  ours-compiled with PassConfig(bucket=False, reorder=False): the traced
                          per-parameter collectives, a block's forward and backward all-gathers and
                          its reduce-scatters one per parameter, none prefetched across frames (2
                          layers: 38/20 a step); the root's too, unless Dynamo runs its first read
                          eagerly, as once ours-fallback ran in the process: it then gathers in a
                          graph of its own, which fsdp_compile.config.passes buckets (37/19)
A mode that fails to build or to run its first step is reported as "unavailable: <reason>";
the others still run. Before any mode, a trivial torch.compile pays Inductor's one-time
start-up, so no compiled mode is charged for it (its time is in the JSON and results.md).

columns:
  step ms             median step time (forward, backward, optimizer) over the measured steps,
                      slowest rank per step; (p10-p90) is the spread
  tokens/s            global tokens per step / median step time
  vs torch-eager      torch-eager's median / this mode's median (>1: faster)
  peak MiB            CPU: peak RSS of the rank process during one extra profiled step, sampled
                      every ms from /proc/self/statm (all modes' models are resident);
                      CUDA: torch.cuda.max_memory_allocated over that step. Max over ranks.
  step +MiB           that peak minus the value just before the step: the mode's own transient
                      memory (activations, unsharded parameters, gradients, buffers)
  saved MiB           bytes of distinct tensors saved for backward in one forward, counted with
                      torch.autograd.graph.saved_tensors_hooks (compiled modes: what the
                      compiled autograd.Function saves)
  coll/step           collectives dispatched to the process group in one step (torch profiler's
                      c10d:: events), as all-gather / reduce-scatter / all-reduce
  compile cold s      sum over the warm-up steps of (step time - median), in a fresh Inductor
                      cache of the mode's own (nothing another mode compiled reused)
  compile warm s      the same for a second model after torch._dynamo.reset() (its cache warm)
  loss rel diff       max over all steps of |loss - loss(ours-eager)| / |loss(ours-eager)|

models (--model):
  transformer         the benchmark's own Llama-style decoder (fsdp_compile/models.py): blocks called
                      positionally as block(x, cos, sin), returning a tensor
  hf-llama            a Llama shaped like Hugging Face's LlamaForCausalLM (benchmarks/hf_llama.py):
                      decoder layers called with keyword arguments (hidden_states=, attention_mask=
                      a 4-D causal mask, position_ids=, cache_position=, position_embeddings=(cos, sin)
                      computed once in the root), each returning a tuple; grouped-query attention
                      (--kv-heads, default --heads / 2, repeat_kv), RMSNorm, rotate_half rotary,
                      F.scaled_dot_product_attention, SiLU-gated MLP, lm head

with --shallow-layers N (in --overhead), a second table per mode (benchmarks/overhead.py):
  host ms per block   (median step at --layers - median step at N layers) / (--layers - N), both depths
                      run interleaved in one process; (p10-p90) of a bootstrap over the steps
  fixed ms per step   the median step at N layers minus N blocks' worth: embedding, loss, root, optimizer
with --profile-step, per mode of ours: cProfile's top functions by own time in one untimed step, and
  from one more step under torch.profiler the aten:: ops dispatched, Dynamo cache lookups, compiled
  regions entered and the leaf guards of the entries that ran

examples:
  python -m benchmarks                                   # defaults, 2 gloo ranks on CPU
  python -m benchmarks --modes ours-eager,torch-eager --steps 30
  python -m benchmarks --pass-ablation                   # + ours-compiled with passes off
  python -m benchmarks --comm-policy                     # + ours with int8 all-gathers / a bf16 gradient wire
  python -m benchmarks --overhead --profile-step --results-md benchmarks/RESULTS.md   # host ms per step and block
  python -m benchmarks --overhead --model hf-llama --profile-step --results-md benchmarks/RESULTS.md
  python -m benchmarks --compile-scaling --results-md benchmarks/RESULTS.md   # compile s at 2-32 layers
  torchrun --nproc-per-node 8 -m benchmarks --dim 2048 --layers 16 --bf16
"""


def _modes(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    known = tuple(dict.fromkeys(MODES + PASS_ABLATION_MODES + COMM_POLICY_MODES + SCALING_MODES))
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}; choose from {', '.join(known)}")
    return names


def _layer_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--compile-scaling takes layer counts like 2,8,16,32; got {text!r}")
    return counts


# --overhead: the host-overhead preset. World size 1 and a model whose compute is ~0, so a step's
# time is the Python and dispatch work of each mode (the runtime's hooks, a frame's entry, guards),
# which on a GPU decides a step at small per-GPU work. Flags given after it override it.
OVERHEAD_PRESET = (
    "--world-size", "1", "--dim", "32", "--heads", "2", "--vocab", "64", "--seq", "8", "--batch", "1",
    "--layers", "16", "--shallow-layers", "4", "--threads", "1", "--steps", "40", "--no-warm-compile", "--foreach-adamw",
    "--modes", "ours-eager,torch-eager,ours-compiled,ours-compiled-regions,ours-blockcompile,torch-blockcompile",
)


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    """Flags -> BenchConfig. Example: ``parse_args(["--steps", "2", "--dim", "64"])``."""
    d = BenchConfig()
    given = sys.argv[1:] if argv is None else list(argv)
    if "--overhead" in given:
        index = given.index("--overhead")
        argv = [*given[:index + 1], *OVERHEAD_PRESET, *given[index + 1:]]  # --overhead kept: it names the section
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Train a Llama-style decoder with every FSDP mode in one run and compare step time,\n"
        "memory, collectives, compile time and loss. Without torchrun it spawns --world-size ranks\n"
        "(CUDA + NCCL when GPUs are present, else CPU + gloo); under torchrun it uses the launcher's ranks.\n"
        "Output: a Markdown table on stdout; results.md, results.json, results.png in --out-dir.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--modes", type=_modes, default=d.modes, help=f"comma-separated modes to run (default: all: {','.join(MODES)})")
    add("--world-size", type=int, default=d.world_size, help=f"ranks to spawn when not started by torchrun (default {d.world_size})")
    add("--device", choices=["auto", "cpu", "cuda"], default=d.device, help="auto: CUDA + NCCL if available, else CPU + gloo")
    add("--dim", type=int, default=d.dim, help=f"model width (default {d.dim})")
    add("--layers", type=int, default=d.layers, help=f"transformer blocks (default {d.layers})")
    add("--heads", type=int, default=d.heads, help=f"attention heads (default {d.heads})")
    add("--vocab", type=int, default=d.vocab, help=f"vocabulary size (default {d.vocab})")
    add("--seq", type=int, default=d.seq, help=f"sequence length (default {d.seq})")
    add("--batch", type=int, default=d.batch, help=f"sequences per rank per step (default {d.batch})")
    add("--model", choices=MODELS, default=d.model,
        help="transformer: the benchmark's own decoder (default); hf-llama: a Llama shaped like Hugging Face's "
        "LlamaForCausalLM (keyword arguments, tuples and a mask into and out of every block, grouped-query attention)")
    add("--kv-heads", type=int, default=None, metavar="N",
        help="hf-llama: key-value heads of the grouped-query attention (default: --heads / 2)")
    add("--untied", action="store_true", help="separate output head (default: head tied to the embedding)")
    add("--tp", type=int, default=d.tp,
        help="tensor-parallel ways (default 1: none): blocks get torchtitan's TP plan on the 'tp' dim of a "
        "(world / tp, tp) mesh and fully_shard shards over 'dp' (FSDP + TP)")
    add("--bf16", action="store_true", help="bf16 parameters for compute, fp32 gradient reduction (MixedPrecisionPolicy)")
    add("--steps", type=int, default=d.steps, help=f"measured steps per mode (default {d.steps})")
    add("--warmup", type=int, default=d.warmup, help=f"warm-up steps per mode, excluded from the figures; they hold compilation (default {d.warmup})")
    add("--seed", type=int, default=d.seed, help=f"seed of the initial weights and the data, the same for every mode (default {d.seed})")
    add("--lr", type=float, default=d.lr, help=f"AdamW learning rate (default {d.lr})")
    add("--foreach-adamw", action="store_true",
        help="AdamW(foreach=True): one dispatch per update op over all parameters, torch's default on CUDA; on CPU "
        "torch defaults to a loop over the parameters, which on --overhead's tiny model is ~60%% of every mode's "
        "step alike and would hide the host time of the GPU run it stands for (in --overhead: on)")
    add("--pass-ablation", action="store_true",
        help=f"also run {' and '.join(PASS_ABLATION_MODES)}: ours-compiled without reordering, and without any graph pass")
    add("--comm-policy", action="store_true",
        help=f"also run {', '.join(COMM_POLICY_MODES)}: ours with an int8 block-quantized all-gather or a bf16 "
        "gradient wire with float32 sums (fsdp_compile.CommPolicy)")
    add("--overhead", action="store_true",
        help="the host-overhead preset (world size 1, a 16-layer model of width 32, 40 steps, the modes each of "
        "ours has an FSDP2 counterpart for, each also at 4 layers for the host time per block): " + " ".join(OVERHEAD_PRESET))
    add("--shallow-layers", type=int, default=None, metavar="N",
        help="also run every mode at N layers, interleaved, and report host ms per block: the step-time slope "
        "between N and --layers (in --overhead: 4)")
    add("--threads", type=int, default=None, metavar="N",
        help="CPU: intra-op threads per rank (default: the cores / ranks; in --overhead 1, as the compute is ~0 "
        "and a second thread only spins against the host work)")
    add("--profile-step", action="store_true",
        help="after the timed steps, profile one step of each of ours: cProfile's top functions, ATen ops "
        "dispatched, Dynamo cache lookups, compiled regions and guards (a sub-section of the results)")
    add("--compile-scaling", nargs="?", const=SCALING_LAYERS, type=_layer_counts, default=None, metavar="LAYERS",
        help=f"instead of one run: {', '.join(SCALING_MODES)} (or --modes) at {','.join(map(str, SCALING_LAYERS))} layers "
        "(or the comma-separated LAYERS), "
        "each layer count twice in fresh processes: cold (empty Inductor cache) and warm (the cache the cold run filled); "
        "prints a table of compile seconds and step ms (with --results-md, also its section there)")
    add("--no-warm-compile", dest="warm_compile", action="store_false",
        help="skip rebuilding each compiled mode after torch._dynamo.reset() to time a warm compile")
    add("--reuse-inductor-cache", dest="fresh_inductor_cache", action="store_false",
        help="use Inductor's usual on-disk cache instead of a fresh one per rank (cold compile is then not cold)")
    add("--out-dir", default=d.out_dir, help=f"where results.md, results.json and results.png go (default {d.out_dir}/)")
    add("--results-md", default=None, metavar="PATH",
        help="also write this run's section (command, versions, date, table) into PATH, e.g. benchmarks/RESULTS.md; "
        "a section of the same machine kind is replaced, others are kept")
    args = parser.parse_args(argv)
    if args.shallow_layers is not None and not 1 <= args.shallow_layers < args.layers:
        parser.error(f"--shallow-layers {args.shallow_layers} must be at least 1 and below --layers {args.layers}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads} must be at least 1")
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1 (warm-up holds compilation and lazy init)")
    if args.tp < 1 or args.world_size % args.tp or args.heads % args.tp:
        parser.error(f"--tp {args.tp} must divide --world-size {args.world_size} and --heads {args.heads}")
    if args.kv_heads is not None and args.model != "hf-llama":
        parser.error("--kv-heads applies to --model hf-llama only")
    if args.model == "hf-llama":
        kv_heads = args.kv_heads if args.kv_heads is not None else max(1, args.heads // 2)
        if kv_heads < 1 or args.heads % kv_heads:
            parser.error(f"--kv-heads {kv_heads} must divide --heads {args.heads}")
        if args.tp > 1 and kv_heads % args.tp:
            parser.error(f"--tp {args.tp} must divide the key-value heads ({kv_heads})")
    if args.dim % args.heads or (args.dim // args.heads) % 2:
        parser.error(f"--dim {args.dim} must split into --heads {args.heads} heads of even size (rotary embedding)")
    launcher = "torchrun ... -m benchmarks" if "TORCHELASTIC_RUN_ID" in os.environ else "python -m benchmarks"
    command = launcher + "".join(f" {a}" for a in (sys.argv[1:] if argv is None else argv))
    if args.pass_ablation:
        args.modes = tuple(args.modes) + tuple(m for m in PASS_ABLATION_MODES if m not in args.modes)
    if args.comm_policy:
        args.modes = tuple(args.modes) + tuple(m for m in COMM_POLICY_MODES if m not in args.modes)
    if args.compile_scaling is not None:
        # Unless named, the scaling modes and a few measured steps per layer count (32 layers is slow).
        if args.modes == d.modes:
            args.modes = SCALING_MODES
        if args.steps == d.steps:
            args.steps = 3
    del args.pass_ablation, args.comm_policy
    return BenchConfig(command=command, **{k: v for k, v in vars(args).items()})
