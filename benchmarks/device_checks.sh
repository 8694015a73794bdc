#!/usr/bin/env bash
# The GPU checks in one command, for an air-gapped GPU machine that has python 3.12, torch, transformers and
# pytest but not the rest of rl360's dependencies. Not part of CI.
#
# Where packages can be downloaded, once: the missing wheels into .whl/ (about 48 MB, under a 64 MiB carry):
#   bash benchmarks/device_checks.sh --fetch-wheels
# Then on the GPU machine, from a copy of the repository holding .whl/ (every part has its own timeout and log;
# about 8 minutes on one H100):
#   bash benchmarks/device_checks.sh [PART ...]      # parts: quickstarts mfu weight_sync gpu_tests (default: all)
# Results go under $OUT (or benchmarks/results/), each JSON named with the device:
#   quickstart_<name>_<device>.json   the default quickstart on one GPU (it must finish: placement colocates the
#                                     engine), colocated server engines in fp32 and bf16, the vision quickstart
#   policy_mfu_<device>.json          the policy update beside plain transformers at 1,024- and 4,096-token
#                                     sequences, with a torch.profiler summary (GPU-busy fraction, top kernels)
#   weight_sync_<device>.json         colocated weight sync in GB/s, CUDA IPC beside host shared memory
#   gpu_tests.log                     the tests marked `gpu` (Transformer Engine's spec among them where TE is
#                                     installed: logits and the round trip against transformers)
# Copy the JSON files into benchmarks/results/ and their figures into docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
if [ "${1:-}" = "--fetch-wheels" ]; then
  script=../shared/device/fetch_wheels.sh
  [ -f "$script" ] || { echo "device_checks: $script not found (the workplace's wheel list)"; exit 1; }
  exec bash "$script"
fi
out=${OUT:-benchmarks/results}
mkdir -p "$out"
if ! python3 -c "import megatron.core, ray, omegaconf" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "device_checks: installing .whl/ failed (run --fetch-wheels where there is a network; carry .whl)"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
device=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1 | tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9-')
device=${device:-unknown}
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(quickstarts mfu weight_sync gpu_tests)
status=0

quickstart() {  # NAME SECONDS ARGS...: one run, then its summary (reward first/last 5, step time, log-prob diff)
  local name=$1 seconds=$2
  shift 2
  local dir="$out/run_$name"
  timeout "$seconds" python3 -m rl360.cli quickstart "$@" "output_dir=$dir" trainer.save_hf=false \
    > "$out/quickstart_$name.log" 2>&1 || { echo "quickstart $name failed (exit $?): $out/quickstart_$name.log"; status=1; }
  grep -m3 "^placement:" "$out/quickstart_$name.log"
  python3 benchmarks/run_summary.py "$name" "$dir" --json "$out/quickstart_${name}_$device.json" \
    --command "rl360 quickstart $*" || status=1
}

for part in "${parts[@]}"; do
  case $part in
    quickstarts)
      quickstart default 240 trainer.total_steps=60
      quickstart server_fp32 180 rollout.engine=server trainer.total_steps=40
      quickstart server_bf16 180 rollout.engine=server model.dtype=bfloat16 trainer.total_steps=40
      quickstart vision 240 --task vision trainer.total_steps=25
      ;;
    mfu)
      timeout 420 python3 benchmarks/policy_mfu.py --attention torch,te --profile --json "$out/policy_mfu_$device.json" \
        2>&1 | tee "$out/policy_mfu.log" || status=1
      ;;
    weight_sync)
      timeout 240 python3 benchmarks/weight_sync_bandwidth.py --json "$out/weight_sync_$device.json" \
        2>&1 | tee "$out/weight_sync.log" || status=1
      ;;
    gpu_tests)
      timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$out/gpu_tests.log" || status=1
      ;;
    *) echo "device_checks: unknown part $part (quickstarts mfu weight_sync gpu_tests)"; status=1 ;;
  esac
done
exit $status
