"""benchmarks/policy_mfu.py: its FLOP count, and one whole run of its tiny shape (as the GPU run goes, on CPU)."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from benchmarks.policy_mfu import (
    interval_union,
    matmul_parameters,
    model_config,
    parse_args,
    peak_tflops,
    profile_step,
    results_path,
    step_flops,
    summarise_profile,
)
from megatron_bridge.layer_spec import resolve_attention, transformer_engine_missing

ROOT = Path(__file__).resolve().parents[1]


def test_matmul_parameters_are_the_models_weights_that_multiply_activations():
    """Every parameter of the transformers model but the embedding, biases and norms, plus the tied output
    layer (it multiplies each hidden state, though it shares the embedding's storage)."""
    for shape in ("qwen2.5-1.5b", "tiny"):
        config = model_config(shape, 1024)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        weights = sum(p.numel() for name, p in model.named_parameters()
                      if name.endswith("weight") and "norm" not in name and "embed_tokens" not in name)
        assert matmul_parameters(config) == weights + config.vocab_size * config.hidden_size
    assert matmul_parameters(model_config("qwen2.5-1.5b", 1024)) == 1_543_569_408


def test_step_flops_adds_causal_attention_to_six_per_parameter_and_token():
    config = model_config("tiny", 64)  # 2 layers, 4 heads of 16
    assert step_flops(config, [10]) == 6 * matmul_parameters(config) * 10 + 6 * 2 * 4 * 16 * 100
    assert step_flops(config, [10, 20]) - step_flops(config, [10]) == \
        6 * matmul_parameters(config) * 20 + 6 * 2 * 4 * 16 * 400


def test_peaks_by_device_name():
    assert peak_tflops("NVIDIA H100 80GB HBM3", None) == (989.0, "H100 dense bf16")
    assert peak_tflops("NVIDIA H100 PCIe", None)[0] == 756.0
    assert peak_tflops("NVIDIA H200", None)[0] == 989.0
    assert peak_tflops("CPU (x86_64)", None)[0] is None
    assert peak_tflops("NVIDIA H100 NVL", None)[0] is None
    assert peak_tflops("CPU (x86_64)", 2.5) == (2.5, "--peak-tflops")
    assert results_path("out", "NVIDIA H100 80GB HBM3").name == "policy_mfu_nvidia-h100-80gb-hbm3.json"


def test_interval_union_counts_overlaps_once():
    assert interval_union([]) == 0.0
    assert interval_union([(0, 10)]) == 10
    assert interval_union([(5, 8), (0, 10), (9, 12)]) == 12  # nested and overlapping: [0, 12]
    assert interval_union([(20, 25), (0, 2), (1, 3), (3, 4)]) == 4 + 5  # touching ends join, a gap does not count
    assert interval_union([(0, 0), (2, 2)]) == 0


def test_profile_summary_of_hand_made_events():
    events = [("gemm", "cuda", 0.0, 40.0), ("gemm", "cuda", 50.0, 90.0), ("softmax", "cuda", 85.0, 95.0),
              ("attn", "cuda", 30.0, 35.0), ("aten::mm", "cpu", 0.0, 20.0), ("aten::add", "cpu", 10.0, 30.0)]
    summary = summarise_profile(events, wall_us=200.0, top=2)
    assert summary["gpu_busy_ms"] * 1e3 == 40 + 45  # [0, 40] and [50, 95]: the attention kernel inside the first
    assert summary["gpu_busy_fraction"] == (40 + 45) / 200
    assert summary["kernel_calls"] == 4 and summary["kernel_ms"] * 1e3 == 40 + 40 + 10 + 5
    assert [(k["name"], k["calls"], k["total_ms"] * 1e3) for k in summary["top_kernels"]] == \
        [("gemm", 2, 80.0), ("softmax", 1, 10.0)]
    assert summary["cpu_op_ms"] * 1e3 == 30 and summary["cpu_busy_fraction"] == 30 / 200
    assert summary["note"] is None
    cpu_only = summarise_profile([("aten::mm", "cpu", 0.0, 20.0)], wall_us=40.0)
    assert cpu_only["gpu_busy_fraction"] is None and cpu_only["top_kernels"] == [] and "no CUDA" in cpu_only["note"]
    assert cpu_only["cpu_busy_fraction"] == 0.5


def test_profile_step_on_this_machine_sees_the_steps_operators():
    x = torch.randn(64, 64)
    summary = profile_step(lambda: (x @ x).sum())
    assert summary["wall_ms"] > 0 and summary["cpu_op_ms"] > 0
    if not torch.cuda.is_available():
        assert summary["gpu_busy_fraction"] is None and summary["kernel_calls"] == 0


def test_default_invocation_runs_both_cases():
    assert parse_args([]).cases == ((1024, 4096, 8), (4096, 16384, 2))  # 32 x 1,024 and 8 x 4,096
    assert parse_args(["--seq-len", "2048", "--tokens-per-micro", "8192"]).cases == [(2048, 8192, 8)]
    assert len(parse_args(["--tiny"]).cases) == 2


def test_tiny_run_end_to_end(tmp_path):
    out = tmp_path / "figures.json"
    command = [sys.executable, "benchmarks/policy_mfu.py", "--tiny", "--peak-tflops", "1", "--profile",
               "--json", str(out)]
    # its own torch.distributed: not the rendezvous this test process may hold (MASTER_PORT of an earlier test)
    env = {key: value for key, value in os.environ.items()
           if key not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["command"].startswith("python benchmarks/policy_mfu.py --tiny")
    assert result["device"] and result["torch"] == torch.__version__ and result["megatron_core"]
    assert [(case["sequences"], case["seq_len"]) for case in result["cases"]] == [(4, 64), (2, 128)]
    for case in result["cases"]:
        assert case["peak_tflops"] == 1.0
        assert case["tokens_per_step"] == case["sequences"] * case["seq_len"] == 256
        labels = set(case["runs"])
        assert "transformers" in labels and "megatron[torch]" in labels and "megatron[te]" in labels
        if transformer_engine_missing() is not None:  # te is recorded as not run, with the reason
            assert case["runs"].pop("megatron[te]") == {"attention": "te", "not_run": resolve_te_error()}
        for label, entry in case["runs"].items():
            for key in ("tokens_per_s", "mfu", "tflops_per_s", "over_transformers"):
                assert math.isfinite(entry[key]) and entry[key] > 0, (label, key, entry)
            assert math.isclose(entry["tokens_per_s"] * entry["seconds"], 256, rel_tol=1e-9)
            if label.startswith("megatron"):  # --profile: one summarised step
                assert entry["profile"]["wall_ms"] > 0 and entry["profile"]["cpu_op_ms"] > 0
    for label in result["cases"][0]["runs"]:  # printed side by side
        assert label in done.stdout
    if transformer_engine_missing() is not None:
        assert re.search(r"megatron\[te\] +not run here: model.attention=te needs Transformer Engine", done.stdout)
    assert "profiled step" in done.stdout


def resolve_te_error() -> str:
    try:
        resolve_attention("te")
    except RuntimeError as error:
        return str(error)
    raise AssertionError("model.attention=te resolved where Transformer Engine is missing")
