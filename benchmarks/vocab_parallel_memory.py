"""Memory and time of the policy's log-probs + entropy (forward and backward) at TP > 1: computed on each
rank's vocabulary slice (`rl360.actor.vocab_parallel`, what the policy does) beside gathering the whole
vocabulary's logits on every rank first (what it did before, and the usual simple approach).

    python benchmarks/vocab_parallel_memory.py                 # from the repo root: TP=2, Qwen2.5 vocabulary
    python benchmarks/vocab_parallel_memory.py --tp 2 --tokens 2048 --vocab 151936

Each rank (a gloo process on CPU) holds its slice of [tokens, vocab] fp32 response logits, resets the
kernel's high-water mark of its resident memory (/proc/self/clear_refs), runs one way, and reads the mark
back; then the other way. Prints per rank the slice's size, both peaks, their ratio, and both times.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def measure_rank(out_dir: str, tokens: str, vocab: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from benchmarks.bridge_load_memory import _peak_added_bytes  # rank processes run from the repo root
    from megatron_bridge.config_map import padded_vocab_size
    from rl360.actor.parallel import destroy_parallel, init_parallel
    from rl360.actor.vocab_parallel import logprobs_and_entropy, without_padding

    tp = int(os.environ["WORLD_SIZE"])  # set by run_ranks
    init_parallel(tp, 1)
    rank = parallel_state.get_tensor_model_parallel_rank()
    vocab_size, count = int(vocab), int(tokens)
    width = padded_vocab_size(vocab_size, tp) // tp
    generator = torch.Generator().manual_seed(rank)
    shard = torch.randn(count, width, generator=generator)
    targets = torch.randint(0, vocab_size, (count,), generator=torch.Generator().manual_seed(99))
    start = rank * width

    def gathered() -> None:
        local = shard.clone().requires_grad_(True)
        full = gather_from_tensor_model_parallel_region(local)[..., :vocab_size]
        logp = torch.log_softmax(full, dim=-1)
        logprobs = logp.gather(-1, targets[:, None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        (logprobs.sum() + 0.01 * entropy.sum()).backward()

    def vocab_parallel() -> None:
        local = shard.clone().requires_grad_(True)
        logprobs, entropy = logprobs_and_entropy(without_padding(local, vocab_size, start), targets, start)
        (logprobs.sum() + 0.01 * entropy.sum()).backward()

    report = {"shard_bytes": shard.numel() * shard.element_size()}
    for name, fn in (("gathered", gathered), ("vocab_parallel", vocab_parallel)):
        fn()  # warm up (allocator, gloo buffers)
        dist.barrier()
        started = time.perf_counter()
        report[f"{name}_peak_bytes"] = _peak_added_bytes(fn)
        report[f"{name}_s"] = time.perf_counter() - started
        dist.barrier()
    Path(f"{out_dir}/vocab_rank{rank}.json").write_text(json.dumps(report))
    destroy_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024, help="response tokens in the micro-batch")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen2.5: 151936)")
    args = parser.parse_args()

    from rl360.cluster.launch import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        run_ranks("benchmarks.vocab_parallel_memory:measure_rank", args.tp, [tmp, str(args.tokens), str(args.vocab)],
                  timeout_s=1200)
        reports = [json.loads((Path(tmp) / f"vocab_rank{rank}.json").read_text()) for rank in range(args.tp)]
    mib = 1 << 20
    print(f"TP={args.tp}, {args.tokens} tokens x vocabulary {args.vocab}, fp32 logits, forward + backward")
    print(f"{'rank':>4} {'slice MiB':>10} {'gathered peak MiB':>18} {'vocab-parallel peak MiB':>24} {'ratio':>6} "
          f"{'gathered s':>11} {'vocab-parallel s':>17} {'speed-up':>9}")
    for rank, r in enumerate(reports):
        print(f"{rank:>4} {r['shard_bytes'] / mib:10.1f} {r['gathered_peak_bytes'] / mib:18.1f} "
              f"{r['vocab_parallel_peak_bytes'] / mib:24.1f} "
              f"{r['gathered_peak_bytes'] / r['vocab_parallel_peak_bytes']:6.2f} {r['gathered_s']:11.3f} "
              f"{r['vocab_parallel_s']:17.3f} {r['gathered_s'] / r['vocab_parallel_s']:9.2f}")


if __name__ == "__main__":
    main()
