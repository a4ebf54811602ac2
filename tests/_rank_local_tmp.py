import copy, warnings, torch
import test_compile_blocks as t
from fsdp_compile import MixedPrecisionPolicy
from fsdp_compile.models import Transformer, TransformerConfig

def run():
    torch._dynamo.reset()
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    ref = Transformer(TransformerConfig(vocab_size=32, dim=16, n_layers=3, n_heads=2, max_seq_len=16))
    m = t._shard(copy.deepcopy(ref), MixedPrecisionPolicy())
    previous = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 1 if rank == 0 else 8
    try:
        r = torch.compile(m, backend="fsdp_aot_eager", dynamic=False)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            try:
                t._train(r, 4, seqs=(12, 12, 8, 8))
                out = "trained"
            except Exception as e:
                out = f"{type(e).__name__}: {str(e)[:600]}"
    finally:
        torch._dynamo.config.recompile_limit = previous
    open(f"/tmp/rank_local_{rank}.txt", "w").write(out)
