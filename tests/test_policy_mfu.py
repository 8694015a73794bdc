"""benchmarks/policy_mfu.py: its FLOP count, and one whole run of its tiny shape (as the GPU run goes, on CPU)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from benchmarks.policy_mfu import matmul_parameters, model_config, peak_tflops, results_path, step_flops

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


def test_tiny_run_end_to_end(tmp_path):
    command = [sys.executable, "benchmarks/policy_mfu.py", "--tiny", "--peak-tflops", "1",
               "--results-dir", str(tmp_path)]
    # its own torch.distributed: not the rendezvous this test process may hold (MASTER_PORT of an earlier test)
    env = {key: value for key, value in os.environ.items()
           if key not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(tmp_path.glob("policy_mfu_*.json")).read_text())
    assert result["command"].startswith("python benchmarks/policy_mfu.py --tiny")
    assert result["device"] and result["peak_tflops"] == 1.0
    assert result["tokens_per_step"] == result["sequences"] * result["seq_len"] == 256
    labels = set(result["runs"])
    assert "transformers" in labels and labels & {"megatron[torch]", "megatron[te]"}
    for label, entry in result["runs"].items():
        for key in ("tokens_per_s", "mfu", "tflops_per_s", "over_transformers"):
            assert math.isfinite(entry[key]) and entry[key] > 0, (label, key, entry)
        assert math.isclose(entry["tokens_per_s"] * entry["seconds"], 256, rel_tol=1e-9)
    for label in result["runs"]:  # printed side by side
        assert label in done.stdout
