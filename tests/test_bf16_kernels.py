"""The bf16 comparisons on both of oneDNN's bf16 paths: the suite runs them with the CPU's own kernels (AVX-512 BF16
or AMX where it has them), and here they run again in a fresh process with ONEDNN_MAX_CPU_ISA=AVX2, where torch
leaves oneDNN out of bf16 matmuls as on an AVX2-only CPU. Both paths round differently, so each comparison's
bound has to hold on both (tests/helpers.py: exact by construction, or `assert_close_bf16`)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# the bf16 comparisons of two computations that may round differently, and one exact by construction
BF16_TESTS = [
    "tests/test_distributed_optimizer.py::test_bf16_distributed_optimizer_trains_as_the_replicated_one",
    "tests/test_policy.py::test_bf16_policy_keeps_fp32_main_weights_and_tracks_fp32_training",
    "tests/test_offload.py::test_offloaded_training_is_bitwise_the_resident_one[bfloat16]",
]
CAPPED = "AVX2"


def _bf16_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(re.findall(r"\b(avx512_bf16|amx_bf16)\b", text))


pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the policy's bf16 runs on CUDA here, not on oneDNN"),
    pytest.mark.skipif(not _bf16_flags(), reason="the CPU has neither AVX-512 BF16 nor AMX: oneDNN's bf16 path "
                                                 "already is the AVX2 one the rest of the suite runs"),
    pytest.mark.skipif("ONEDNN_MAX_CPU_ISA" in os.environ,
                       reason="the suite itself runs with ONEDNN_MAX_CPU_ISA set: there is one path only"),
]


# set in this process by an earlier test's torch.distributed (its store holds MASTER_PORT): a fresh process makes
# its own
_THIS_PROCESS_ONLY = {"ONEDNN_MAX_CPU_ISA", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"}


def _env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in _THIS_PROCESS_ONLY}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env | extra


def _bf16_matmul_kernels(**extra: str) -> list[str]:
    """The oneDNN implementations that run a bf16 linear layer in a fresh process with `extra` in its environment."""
    probe = ("import torch; x = torch.randn(8, 64).bfloat16(); "
             "torch.nn.functional.linear(x, torch.randn(128, 64).bfloat16())")
    done = subprocess.run([sys.executable, "-c", probe], env=_env(ONEDNN_VERBOSE="1", **extra),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return [line.split(",")[6] for line in done.stdout.splitlines()
            if line.startswith("onednn_verbose,") and ",primitive,exec,cpu,matmul," in line]


def test_the_capped_isa_takes_bf16_matmuls_off_the_avx512_and_amx_kernels():
    default, capped = _bf16_matmul_kernels(), _bf16_matmul_kernels(ONEDNN_MAX_CPU_ISA=CAPPED)
    assert any(re.search("avx512|amx", kernel) for kernel in default), (default, _bf16_flags())
    assert not any(re.search("avx512|amx", kernel) for kernel in capped), capped


def test_bf16_comparisons_hold_with_onednn_capped_at_avx2():
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *BF16_TESTS],
                          cwd=ROOT, env=_env(ONEDNN_MAX_CPU_ISA=CAPPED), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert f"{len(BF16_TESTS)} passed" in done.stdout, done.stdout[-3000:]
