"""Resident memory each rank adds while loading a Hugging Face checkpoint through the bridge, beside a
rank that reads the whole checkpoint (safetensors `load_file`, every tensor copied) and then slices it.

    python benchmarks/bridge_load_memory.py          # from the repo root: 268 MB Qwen2, TP=2 x PP=2, 4 processes
    python benchmarks/bridge_load_memory.py --layers 32 --tp 2 --pp 2

Each rank builds its model chunk, resets the kernel's high-water mark of its resident memory
(/proc/self/clear_refs), loads, and reads the high-water mark back; then does the same for the
whole-file read. Prints, per rank, its share of the model and both peaks, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _peak_added_bytes(fn) -> int:
    """Resident memory `fn` adds at its peak, in bytes (Linux)."""
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) * 1024


def measure_rank(hf_dir: str, out_dir: str, tp: str, pp: str) -> None:
    """One rank: its share, the peak its bridge load adds, and the peak a whole-file read adds."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from megatron_bridge import Bridge
    from rl360.actor.parallel import destroy_parallel, init_parallel

    init_parallel(int(tp), int(pp))
    bridge = Bridge.from_hf_pretrained(hf_dir)
    models = bridge.to_megatron_model(load_weights=False)
    share = sum(p.numel() * p.element_size() for p in models[0].parameters())
    bridge_peak = _peak_added_bytes(lambda: bridge.load_hf_weights(models))

    def whole_read() -> None:
        tensors = {name: tensor.clone() for name, tensor in load_file(f"{hf_dir}/model.safetensors").items()}
        del tensors

    whole_peak = _peak_added_bytes(whole_read)
    Path(f"{out_dir}/memory_rank{dist.get_rank()}.json").write_text(json.dumps(
        {"share_bytes": share, "load_peak_bytes": bridge_peak, "whole_read_peak_bytes": whole_peak}))
    destroy_parallel()


def make_model(out_dir: str, layers: int) -> str:
    """A random untied Qwen2 of hidden 512, ffn 2048, vocab 4096 (16 layers: 268 MB in fp32)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(out_dir)
    return out_dir


def run(hf_dir: str, out_dir: str, tp: int, pp: int) -> list[dict]:
    """Measure every rank of a TP x PP layout; one report per rank."""
    from rl360.cluster.launch import run_ranks

    run_ranks("benchmarks.bridge_load_memory:measure_rank", tp * pp, [hf_dir, out_dir, str(tp), str(pp)],
              timeout_s=1200)
    return [json.loads((Path(out_dir) / f"memory_rank{rank}.json").read_text()) for rank in range(tp * pp)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        hf = make_model(f"{tmp}/hf", args.layers)
        size = (Path(hf) / "model.safetensors").stat().st_size
        reports = run(hf, tmp, args.tp, args.pp)
    mib = 1 << 20
    print(f"checkpoint {size / mib:.0f} MiB, TP={args.tp} x PP={args.pp}")
    print(f"{'rank':>4} {'share MiB':>10} {'bridge load peak MiB':>21} {'whole-file read peak MiB':>25} {'ratio':>7}")
    for rank, r in enumerate(reports):
        print(f"{rank:>4} {r['share_bytes'] / mib:10.1f} {r['load_peak_bytes'] / mib:21.1f} "
              f"{r['whole_read_peak_bytes'] / mib:25.1f} {r['whole_read_peak_bytes'] / r['load_peak_bytes']:7.1f}")


if __name__ == "__main__":
    main()
