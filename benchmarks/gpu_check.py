"""One-GPU check of the CUDA path (NCCL, world size 1): eager, whole-model fsdp_inductor (regions and
block frames) and per-block compile against eager numerics, with step times. Run on a lent GPU."""
import copy, os, sys, time, traceback
import torch, torch.distributed as dist

def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    import fsdp_compile
    from fsdp_compile import MixedPrecisionPolicy, fully_shard
    from fsdp_compile.models import Transformer, TransformerConfig
    print("torch", torch.__version__, torch.cuda.get_device_name(), flush=True)
    cfg = TransformerConfig(vocab_size=4096, dim=1024, n_layers=8, n_heads=16, max_seq_len=1024)
    torch.manual_seed(0)
    reference = Transformer(cfg)
    tokens = [torch.randint(0, cfg.vocab_size, (4, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(s)) for s in range(int(os.environ.get("STEPS", "6")))]

    def build(mode):
        model = copy.deepcopy(reference).cuda()
        if mode.startswith("torch-"):
            from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy, fully_shard as torch_fully_shard
            if mode == "torch-blockcompile":
                for index, block in model.layers.named_children():
                    model.layers.register_module(index, torch.compile(block, fullgraph=True))
            policy = TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in model.layers:
                torch_fully_shard(block, mp_policy=policy)
            torch_fully_shard(model, mp_policy=policy)
            return model, model
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        runner = model
        if mode in ("regions", "frames"):
            runner = torch.compile(model, backend="fsdp_inductor")
        elif mode == "blockcompile":
            for block in model.layers:
                block.compile(backend="fsdp_inductor")
        return model, runner

    results = {}
    for mode in sys.argv[1].split(",") if len(sys.argv) > 1 else ("eager", "regions", "frames", "blockcompile", "torch-eager", "torch-blockcompile"):
        torch._dynamo.reset()
        fsdp_compile.config.compile_blocks_as_frames = mode == "frames"
        try:
            model, runner = build(mode)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            losses, times = [], []
            for t in tokens:
                torch.cuda.synchronize(); start = time.perf_counter()
                logits = runner(t)
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), t[:, 1:].flatten())
                loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize(); times.append(time.perf_counter() - start)
                losses.append(loss.item())
            results[mode] = (losses, times, torch.cuda.max_memory_allocated() / 2**20)
            torch.cuda.reset_peak_memory_stats()
            print(mode, "losses", [round(l, 5) for l in losses], "first step s", round(times[0], 2),
                  "median later ms", round(1000 * sorted(times[2:])[len(times[2:]) // 2], 2), "peak MiB", round(results[mode][2]), flush=True)
        except Exception:
            print(mode, "FAILED"); traceback.print_exc(limit=12)
    if "eager" in results:
        for mode, (losses, _, _) in results.items():  # torch's: its own FSDP on the same weights and batches
            gap = max(abs(a - b) / abs(a) for a, b in zip(results["eager"][0], losses))
            print(f"{mode:13s} max rel loss gap vs eager {gap:.2e}")
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
