"""Policy-update throughput and MFU: rl360's Megatron policy beside plain transformers, same tokens, same GPU.

    python benchmarks/policy_mfu.py                 # on one GPU: Qwen2.5-1.5B shape, both cases, no network
    python benchmarks/policy_mfu.py --profile       # and one profiled step of the megatron update per case
    python benchmarks/policy_mfu.py --tiny --peak-tflops 1   # a tiny shape that runs anywhere (CPU: ~30 s)

Random weights from a config (nothing is downloaded): Qwen2.5-1.5B's shape by default (hidden 1536, 28 layers,
12 heads / 2 key-value heads, intermediate 8960, vocabulary 151936, tied embeddings, q/k/v bias), bf16. One
transformers model is created on the device and saved to a temporary directory; rl360's policy loads those same
weights through the bridge.

One step is the forward and backward pass over `--micro-batches` micro-batches of `--tokens-per-micro` tokens
each: sequences of `--seq-len` tokens (a quarter prompt, the rest response), packed back to back into one row per
micro-batch. Without `--seq-len` one invocation runs two cases: 32 sequences of 1,024 tokens packed 4,096 a
micro-batch, and 8 sequences of 4,096 tokens packed 16,384 a micro-batch (`--tiny`: 4 x 64 packed 128 and
2 x 128 packed 256).

`--profile`: one more step of each megatron run under `torch.profiler`, summarised: the GPU-busy fraction (the
union of the CUDA kernels' intervals over the step's wall time), the ten kernels of most total time with their
call counts, and the host's time inside torch operators (on a CPU: no CUDA kernels, the CPU-busy fraction).

- `megatron[<spec>]`: `PolicyWorker.accumulate_gradients` (rl360's update without the optimizer step: megatron's
  forward-backward schedule, packed THD rows, vocabulary-parallel log-probs, the PPO loss, gradients in megatron's
  fp32 buffers), once per layer spec named in `--attention` (default `torch,te`: Transformer Engine's spec where
  it can run, recorded as not run elsewhere);
- `transformers`: `AutoModelForCausalLM.from_config(..., attn_implementation="sdpa")` in bf16, the same sequences
  as a [sequences, seq-len] batch (equal lengths, so no padding and the same attention work as the packed rows),
  log-probs of the response tokens times an advantage, backward.

Each is warmed up once, then timed over `--repeats` steps. Printed side by side: tokens/s, MFU and each one's
throughput over transformers'. MFU = (6 x matmul parameters x tokens + causal attention FLOPs) / (seconds x peak);
matmul parameters are every projection and the output layer (the embedding lookup is not a matmul);
attention FLOPs of one sequence of s tokens, forward and backward, 6 x layers x heads x head_dim x s^2 (QK^T and
AV, causal half, backward twice the forward). The peak is the GPU's dense bf16 figure (H100 SXM and H200: 989
TFLOP/s, H100 PCIe 756, A100 312), or `--peak-tflops`; without either (a CPU, an NVL part) MFU is not given.
The figures go to `--json PATH` (default `benchmarks/results/policy_mfu_<device>.json`) with the command, the
device's name and the torch and megatron-core versions.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
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
from rl360.actor.settings import PolicySettings
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
# the cases one invocation runs: (tokens a sequence, packed tokens a micro-batch, micro-batches a step)
CASES = ((1024, 4096, 8), (4096, 16384, 2))
TINY_CASES = ((64, 128, 2), (128, 256, 1))
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
    worker = PolicyWorker(PolicySettings.of(cfg))
    prompts = [row[:prompt].tolist() for row in sequences]
    responses = [row[prompt:].tolist() for row in sequences]
    batch = build_batch(prompts, responses, [[-1.0] * len(r) for r in responses])
    batch.old_logprobs = torch.full_like(batch.response_mask, -1.0)
    batch.advantages = torch.linspace(-1.0, 1.0, count)[:, None] * batch.response_mask
    return worker, lambda: worker.accumulate_gradients(batch)


def run(args: argparse.Namespace) -> dict:
    """Every case of `args.cases`; the figures of each, and where and how they were taken."""
    cases = [run_case(args, *case) for case in args.cases]
    return {"command": " ".join(["python benchmarks/policy_mfu.py", *args.argv]), "device": device_name(),
            "torch": torch.__version__, "megatron_core": _version("megatron-core"),
            "transformers": _version("transformers"), "cases": cases}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_case(args: argparse.Namespace, seq_len: int, tokens_per_micro: int, micro_batches: int) -> dict:
    shape = "tiny" if args.tiny else args.shape
    config = model_config(shape, seq_len)
    if tokens_per_micro % seq_len:
        raise SystemExit(f"--tokens-per-micro={tokens_per_micro} must be a multiple of --seq-len={seq_len}")
    per_micro = tokens_per_micro // seq_len
    count = per_micro * micro_batches
    if count % 2:
        raise SystemExit(f"{count} sequences a step: make --micro-batches x sequences per micro-batch even")
    prompt = max(1, int(seq_len * PROMPT_FRACTION))
    sequences = make_sequences(config, count, seq_len)
    flops = step_flops(config, [seq_len] * count)
    tokens = count * seq_len
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
            try:
                spec = resolve_attention(requested)
            except RuntimeError as error:  # te where Transformer Engine cannot run: recorded, the others run
                runs[f"megatron[{requested}]"] = {"attention": requested, "not_run": str(error)}
                print(f"megatron[{requested}] not run: {error}", file=sys.stderr)
                continue
            label = f"megatron[{spec}]"
            if label in runs:  # auto resolved to a spec already measured
                continue
            try:
                worker, step = megatron_step(tmp, spec, sequences, prompt, tokens_per_micro, args.dtype)
                record(label, timed(step, args.repeats), attention=requested)
                if args.profile:
                    runs[label]["profile"] = profile_step(step)
                del worker, step
            except Exception as error:  # one spec failing (a first run of TE) leaves the others' figures standing
                runs[label] = {"attention": requested, "error": f"{type(error).__name__}: {error}"}
                print(f"{label} failed: {runs[label]['error']}", file=sys.stderr)
            _free()
    baseline = runs["transformers"]["tokens_per_s"]
    for entry in runs.values():
        if "tokens_per_s" in entry:
            entry["over_transformers"] = entry["tokens_per_s"] / baseline
    return {"shape": shape, "model": {k: getattr(config, k) for k in SHAPES[shape]} | {"tie_word_embeddings": True},
            "dtype": args.dtype, "sequences": count, "seq_len": seq_len, "prompt_len": prompt,
            "tokens_per_step": tokens, "tokens_per_micro_batch": tokens_per_micro,
            "matmul_parameters": matmul_parameters(config), "flops_per_step": flops,
            "peak_tflops": peak, "peak_source": peak_source, "repeats": args.repeats, "runs": runs}


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def report(result: dict) -> str:
    """Every case's runs side by side, then each profiled run's summary."""
    lines = [f"{result['device']}: torch {result['torch']}, megatron-core {result['megatron_core']}"]
    for case in result["cases"]:
        lines += ["", f"{case['shape']} ({case['matmul_parameters'] / 1e6:,.1f}M matmul parameters), {case['dtype']}, "
                  f"{case['sequences']} x {case['seq_len']} tokens a step in micro-batches of "
                  f"{case['tokens_per_micro_batch']}; peak {case['peak_tflops']} TFLOP/s ({case['peak_source']})"]
        for label, entry in case["runs"].items():
            if "error" in entry or "not_run" in entry:
                lines.append(f"  {label:18} " + (f"failed: {entry['error']}" if "error" in entry else
                                                 f"not run here: {entry['not_run']}"))
                continue
            mfu = f"{100 * entry['mfu']:5.1f}%" if entry["mfu"] is not None else "    -"
            lines.append(f"  {label:18} {entry['tokens_per_s']:12,.0f} tokens/s  {entry['tflops_per_s']:8.2f} TFLOP/s  "
                         f"MFU {mfu}  {entry['seconds']:8.3f} s/step  {entry['over_transformers']:5.2f}x transformers")
        for label, entry in case["runs"].items():
            if "profile" in entry:
                lines += [f"  {label} profiled step:", *("    " + line for line in profile_report(entry["profile"]))]
    return "\n".join(lines)


# ---- profile of one step ------------------------------------------------------------------------------------

def interval_union(intervals) -> float:
    """Total length covered by the (start, end) `intervals` (overlaps counted once)."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total, reach = total + max(end - start, 0.0), end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


def summarise_profile(events, wall_us: float, top: int = 10) -> dict:
    """Summary of one profiled step from its `events`, (name, kind, start_us, end_us) with kind "cuda" (a kernel)
    or "cpu" (a host operator), and the step's wall time: the GPU-busy fraction (union of the kernels' intervals
    over the wall time; None when the trace has no kernel), the `top` kernels by total time with call counts,
    the host's time inside operators (the union of their intervals) and its fraction of the wall time."""
    kernels = [(name, start, end) for name, kind, start, end in events if kind == "cuda"]
    host = [(start, end) for _, kind, start, end in events if kind == "cpu"]
    totals: dict[str, list] = {}
    for name, start, end in kernels:
        entry = totals.setdefault(name, [0.0, 0])
        entry[0] += end - start
        entry[1] += 1
    busy = interval_union((start, end) for _, start, end in kernels)
    cpu = interval_union(host)
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    return {"wall_ms": wall_us / 1e3,
            "gpu_busy_ms": busy / 1e3 if kernels else None,
            "gpu_busy_fraction": busy / wall_us if kernels and wall_us > 0 else None,
            "kernel_ms": sum(total for total, _ in totals.values()) / 1e3, "kernel_calls": len(kernels),
            "cpu_op_ms": cpu / 1e3, "cpu_busy_fraction": cpu / wall_us if wall_us > 0 else None,
            "top_kernels": [{"name": name, "total_ms": total / 1e3, "calls": calls}
                            for name, (total, calls) in ranked],
            "note": None if kernels else "no CUDA kernels in the trace (a CPU run): the CPU-busy fraction stands in"}


def profile_step(step) -> dict:
    """One call of `step` under torch.profiler (CPU operators, and CUDA kernels on a GPU), summarised."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    synchronize()
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        step()
        synchronize()
        wall_us = (time.perf_counter() - started) * 1e6
    events = []
    for event in prof.events():
        kind = "cuda" if event.device_type == DeviceType.CUDA else "cpu" if event.device_type == DeviceType.CPU \
            else None
        if kind is not None:
            events.append((event.name, kind, float(event.time_range.start), float(event.time_range.end)))
    return summarise_profile(events, wall_us)


def profile_report(summary: dict) -> list[str]:
    busy = summary["gpu_busy_fraction"]
    lines = [f"wall {summary['wall_ms']:.1f} ms, GPU busy "
             + (f"{100 * busy:.1f}% ({summary['gpu_busy_ms']:.1f} ms, {summary['kernel_calls']} kernels)"
                if busy is not None else "- (no CUDA kernels)")
             + f", CPU in operators {summary['cpu_op_ms']:.1f} ms ({100 * (summary['cpu_busy_fraction'] or 0):.1f}%)"]
    lines += [f"{k['total_ms']:10.2f} ms {k['calls']:6d} x  {k['name'][:100]}" for k in summary["top_kernels"]]
    return lines


def results_path(results_dir: str, device: str) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    return Path(results_dir) / f"policy_mfu_{slug}.json"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape, short sequences (CPU, tests)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens a sequence (default: both cases)")
    parser.add_argument("--tokens-per-micro", type=int, default=None, help="packed tokens a micro-batch (with "
                        "--seq-len; default 4 sequences)")
    parser.add_argument("--micro-batches", type=int, default=None, help="micro-batches a step (with --seq-len; "
                        "default 8, --tiny 2)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps after one warm-up (3; --tiny 1)")
    parser.add_argument("--attention", default="torch,te", help="model.attention values to run, comma-separated")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak, when not in the table")
    parser.add_argument("--profile", action="store_true", help="one profiled step of each megatron run, summarised")
    parser.add_argument("--results-dir", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--json", default=None, help="where the figures go (default: policy_mfu_<device>.json "
                        "in --results-dir)")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.tiny else 3
    if args.seq_len is None:  # (seq_len, tokens a micro-batch, micro-batches): 32 x 1,024 and 8 x 4,096 (tiny: smaller)
        if args.tokens_per_micro is not None or args.micro_batches is not None:
            raise SystemExit("--tokens-per-micro and --micro-batches go with --seq-len")
        args.cases = TINY_CASES if args.tiny else CASES
    else:
        args.cases = [(args.seq_len, args.tokens_per_micro or 4 * args.seq_len,
                       args.micro_batches or (2 if args.tiny else 8))]
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = run(args)
    print(report(result))
    path = Path(args.json) if args.json else results_path(args.results_dir, result["device"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written {path}")
    if any("error" in entry for case in result["cases"] for entry in case["runs"].values()):
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
