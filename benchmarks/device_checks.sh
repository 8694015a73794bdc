#!/usr/bin/env bash
# Issue 16's GPU checks as one command, for a session lent a device machine (H100 / H200 with python 3.12, torch,
# transformers, pytest, no network and no Transformer Engine). Not part of CI, and not yet run on a device.
#
# Here, once: the wheels the device lacks (megatron-core, omegaconf and its antlr4 runtime) into .whl/ (ignored):
#   bash benchmarks/device_checks.sh --fetch-wheels
# Then one device `run`, carrying .whl, with a timeout that leaves room for a second try (e.g. 480 s):
#   bash benchmarks/device_checks.sh
# It writes under $OUT (or benchmarks/results/ when OUT is unset): policy_mfu_<device>.json and its log (the
# policy update's MFU beside plain transformers, benchmarks/policy_mfu.py) and gpu_tests.log (the tests marked
# `gpu`, those that need Transformer Engine skip themselves); copy the json into benchmarks/results/ and the
# figures, command and device into the README.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
WHEELS=(megatron-core==0.16.1 omegaconf==2.3.0)
if [ "${1:-}" = "--fetch-wheels" ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  mkdir -p .whl
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}" || exit 1
  python3 -m pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3 || exit 1  # published as a source archive
  ls -l .whl
  exit 0
fi
out=${OUT:-benchmarks/results}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "device_checks: installing .whl/ failed (run --fetch-wheels here and carry .whl)"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
status=0
timeout 300 python3 benchmarks/policy_mfu.py --results-dir "$out" 2>&1 | tee "$out/policy_mfu.log" || status=1
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_bridge.py tests/test_policy.py \
  tests/test_layer_spec.py 2>&1 | tee "$out/gpu_tests.log" || status=1
exit $status
