"""Policy-update throughput and MFU: rl360's Megatron policy beside plain transformers, same tokens, same GPU.

    python benchmarks/policy_mfu.py                 # on one GPU: Qwen2.5-1.5B shape, about 2 minutes, no network
    python benchmarks/policy_mfu.py --tiny --peak-tflops 1   # a tiny shape that runs anywhere (CPU: ~20 s)

Random weights from a config (nothing is downloaded): Qwen2.5-1.5B's shape by default (hidden 1536, 28 layers,
12 heads / 2 key-value heads, intermediate 8960, vocabulary 151936, tied embeddings, q/k/v bias), bf16. One
transformers model is created on the device and saved to a temporary directory; rl360's policy loads those same
weights through the bridge.

One step is the forward and backward pass over `--micro-batches` micro-batches of `--tokens-per-micro` tokens
each (default 8 x 4,096): sequences of `--seq-len` tokens (default 1,024: a 256-token prompt and a 768-token
response), packed back to back into one row per micro-batch.

- `megatron[<spec>]`: `PolicyWorker.accumulate_gradients` (rl360's update without the optimizer step: megatron's
  forward-backward schedule, packed THD rows, vocabulary-parallel log-probs, the PPO loss, gradients in megatron's
  fp32 buffers), once per layer spec named in `--attention` (default `auto,torch`: on a GPU with Transformer
  Engine that is `te` and `torch`; without it, `torch` once);
- `transformers`: `AutoModelForCausalLM.from_config(..., attn_implementation="sdpa")` in bf16, the same sequences
  as a [sequences, seq-len] batch (equal lengths, so no padding and the same attention work as the packed rows),
  log-probs of the response tokens times an advantage, backward.

Each is warmed up once, then timed over `--repeats` steps. Printed side by side: tokens/s, MFU and each one's
throughput over transformers'. MFU = (6 x matmul parameters x tokens + causal attention FLOPs) / (seconds x peak);
matmul parameters are every projection and the output layer (the embedding lookup is not a matmul);
attention FLOPs of one sequence of s tokens, forward and backward, 6 x layers x heads x head_dim x s^2 (QK^T and
AV, causal half, backward twice the forward). The peak is the GPU's dense bf16 figure (H100 SXM and H200: 989
TFLOP/s, H100 PCIe 756, A100 312), or `--peak-tflops`; without either (a CPU, an NVL part) MFU is not given.
The figures go to `benchmarks/results/policy_mfu_<device>.json` with the command and the device's name.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from megatron_bridge.layer_spec import resolve_attention
from rl360.actor.batch import build_batch
from rl360.actor.parallel import init_parallel
from rl360.actor.policy import PolicyWorker
from rl360.config import load_config

SHAPES = {
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512),
}
# dense bf16 tensor-core peaks, TFLOP/s, by a part of torch.cuda.get_device_name() (first match wins); None: the
# NVL parts, whose clocks and so peaks differ from the SXM ones, need --peak-tflops
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("NVL", None), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))
PROMPT_FRACTION = 0.25  # of each sequence; the rest is the response whose log-probs the loss takes


def model_config(shape: str, max_positions: int) -> Qwen2Config:
    return Qwen2Config(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=max(max_positions, 4096),
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, initializer_range=0.02)


def matmul_parameters(config: Qwen2Config) -> int:
    """Weights that multiply activations, per token: every layer's projections and the output layer."""
    hidden, heads, groups = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden // heads
    attention = hidden * heads * head_dim + 2 * hidden * groups * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * config.intermediate_size
    return config.num_hidden_layers * (attention + mlp) + config.vocab_size * hidden


def step_flops(config: Qwen2Config, sequence_lengths: list[int]) -> float:
    """Forward + backward FLOPs of one step over `sequence_lengths` (see the module docstring)."""
    head_dim = config.hidden_size // config.num_attention_heads
    attention = 6 * config.num_hidden_layers * config.num_attention_heads * head_dim * sum(s * s for s in
                                                                                            sequence_lengths)
    return 6.0 * matmul_parameters(config) * sum(sequence_lengths) + attention


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.machine()})"


def peak_tflops(name: str, given: float | None) -> tuple[float | None, str]:
    """(peak, where it comes from)."""
    if given is not None:
        return given, "--peak-tflops"
    for part, peak in PEAK_TFLOPS:
        if part in name and peak is not None:
            return peak, f"{part} dense bf16"
        if part in name:
            break
    return None, f"no known peak for {name}: pass --peak-tflops"


def make_sequences(config: Qwen2Config, count: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, config.vocab_size, (count, length), generator=generator)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(step, repeats: int) -> float:
    """Seconds per call of `step` after one warm-up call."""
    step()
    synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        step()
    synchronize()
    return (time.perf_counter() - started) / repeats


def transformers_step(model, sequences: torch.Tensor, prompt: int, micro_rows: int):
    """Forward + backward of the sequences, `micro_rows` rows at a time: response log-probs times an advantage."""
    device = next(model.parameters()).device
    rows = sequences.to(device)
    advantages = torch.linspace(-1.0, 1.0, rows.shape[0], device=device)

    def step():
        model.zero_grad(set_to_none=False)
        for start in range(0, rows.shape[0], micro_rows):
            ids = rows[start:start + micro_rows]
            logits = model(input_ids=ids).logits[:, prompt - 1:-1].float()
            logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, prompt:, None]).squeeze(-1)
            loss = -(logprobs * advantages[start:start + micro_rows, None]).mean()
            loss.backward()

    return step


def megatron_step(hf_dir: str, attention: str, sequences: torch.Tensor, prompt: int, tokens_per_micro: int,
                  dtype: str):
    """rl360's policy over the same sequences, packed (`actor.pack_sequences`), `tokens_per_micro` a micro-batch."""
    count, length = sequences.shape
    cfg = load_config(None, [
        f"model.path={hf_dir}", "data.train_files=[unused.parquet]", f"model.dtype={dtype}",
        f"model.attention={attention}", "rollout.n=2", f"data.batch_size={count // 2}",
        f"actor.ppo_mini_batch_size={count // 2}", f"rollout.max_response_length={length - prompt}",
        "algorithm.kl_coef=0", "actor.pack_sequences=true", f"actor.max_tokens_per_micro_batch={tokens_per_micro}"])
    worker = PolicyWorker(cfg)
    prompts = [row[:prompt].tolist() for row in sequences]
    responses = [row[prompt:].tolist() for row in sequences]
    batch = build_batch(prompts, responses, [[-1.0] * len(r) for r in responses])
    batch.old_logprobs = torch.full_like(batch.response_mask, -1.0)
    batch.advantages = torch.linspace(-1.0, 1.0, count)[:, None] * batch.response_mask
    return worker, lambda: worker.accumulate_gradients(batch)


def run(args: argparse.Namespace) -> dict:
    shape = "tiny" if args.tiny else args.shape
    config = model_config(shape, args.seq_len)
    if args.tokens_per_micro % args.seq_len:
        raise SystemExit(f"--tokens-per-micro={args.tokens_per_micro} must be a multiple of --seq-len={args.seq_len}")
    per_micro = args.tokens_per_micro // args.seq_len
    count = per_micro * args.micro_batches
    if count % 2:
        raise SystemExit(f"{count} sequences a step: make --micro-batches x sequences per micro-batch even")
    prompt = max(1, int(args.seq_len * PROMPT_FRACTION))
    sequences = make_sequences(config, count, args.seq_len)
    flops = step_flops(config, [args.seq_len] * count)
    tokens = count * args.seq_len
    name = device_name()
    peak, peak_source = peak_tflops(name, args.peak_tflops)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    init_parallel()
    runs = {}

    def record(label: str, seconds: float, **extra) -> None:
        runs[label] = {"seconds": seconds, "tokens_per_s": tokens / seconds,
                       "tflops_per_s": flops / seconds / 1e12,
                       "mfu": flops / seconds / (peak * 1e12) if peak else None, **extra}

    with tempfile.TemporaryDirectory(prefix="rl360-mfu-") as tmp:
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        model.save_pretrained(tmp)  # the weights the policy loads: both compute on the same model
        model.train()
        record("transformers", timed(transformers_step(model, sequences, prompt, per_micro), args.repeats))
        del model
        _free()
        for requested in args.attention.split(","):
            spec = resolve_attention(requested)
            label = f"megatron[{spec}]"
            if label in runs:  # auto resolved to a spec already measured
                continue
            try:
                worker, step = megatron_step(tmp, spec, sequences, prompt, args.tokens_per_micro, args.dtype)
                record(label, timed(step, args.repeats), attention=requested)
                del worker, step
            except Exception as error:  # one spec failing (a first run of TE) leaves the others' figures standing
                runs[label] = {"attention": requested, "error": f"{type(error).__name__}: {error}"}
                print(f"{label} failed: {runs[label]['error']}", file=sys.stderr)
            _free()
    baseline = runs["transformers"]["tokens_per_s"]
    for entry in runs.values():
        if "error" not in entry:
            entry["over_transformers"] = entry["tokens_per_s"] / baseline
    return {"command": " ".join(["python benchmarks/policy_mfu.py", *args.argv]), "device": name,
            "shape": shape, "model": {k: getattr(config, k) for k in SHAPES[shape]} | {"tie_word_embeddings": True},
            "dtype": args.dtype, "sequences": count, "seq_len": args.seq_len, "prompt_len": prompt,
            "tokens_per_step": tokens, "tokens_per_micro_batch": args.tokens_per_micro,
            "matmul_parameters": matmul_parameters(config), "flops_per_step": flops,
            "peak_tflops": peak, "peak_source": peak_source, "repeats": args.repeats, "runs": runs}


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def report(result: dict) -> str:
    lines = [f"{result['device']}: {result['shape']} ({result['matmul_parameters'] / 1e6:,.1f}M matmul parameters), "
             f"{result['dtype']}, {result['sequences']} x {result['seq_len']} tokens a step in micro-batches of "
             f"{result['tokens_per_micro_batch']}; peak {result['peak_tflops']} TFLOP/s ({result['peak_source']})"]
    for label, entry in result["runs"].items():
        if "error" in entry:
            lines.append(f"{label:18} failed: {entry['error']}")
            continue
        mfu = f"{100 * entry['mfu']:5.1f}%" if entry["mfu"] is not None else "    -"
        lines.append(f"{label:18} {entry['tokens_per_s']:12,.0f} tokens/s  {entry['tflops_per_s']:8.2f} TFLOP/s  "
                     f"MFU {mfu}  {entry['seconds']:8.3f} s/step  {entry['over_transformers']:5.2f}x")
    return "\n".join(lines)


def results_path(results_dir: str, device: str) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    return Path(results_dir) / f"policy_mfu_{slug}.json"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape, short sequences (CPU, tests)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens a sequence (1024; --tiny 64)")
    parser.add_argument("--tokens-per-micro", type=int, default=None, help="packed tokens a micro-batch (4096; "
                        "--tiny 128)")
    parser.add_argument("--micro-batches", type=int, default=None, help="micro-batches a step (8; --tiny 2)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps after one warm-up (3; --tiny 1)")
    parser.add_argument("--attention", default="auto,torch", help="model.attention values to run, comma-separated")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak, when not in the table")
    parser.add_argument("--results-dir", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    defaults = {"seq_len": (1024, 64), "tokens_per_micro": (4096, 128), "micro_batches": (8, 2), "repeats": (3, 1)}
    for key, (full, tiny) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else full)
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = run(args)
    print(report(result))
    path = results_path(args.results_dir, result["device"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written {path}")
    if any("error" in entry for entry in result["runs"].values()):
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
