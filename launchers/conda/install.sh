#!/usr/bin/env bash
# Create rl360's conda environment for clusters without containers, with the pins of launchers/versions.env (the
# same as docker/Dockerfile's): launchers/conda/environment.yml, then Transformer Engine and Apex built from source
# against its torch and CUDA 13.0 toolkit, then rl360 itself (editable, from this checkout).
#
#   bash launchers/conda/install.sh            # environment `rl360`
#   RL360_CONDA_ENV=rl360-dev bash launchers/conda/install.sh
#
# Run it on a node with the cluster's compilers in reach (a GPU is not needed; nothing is run on one). Variables:
# RL360_CONDA_ENV (environment name, default rl360), CONDA_EXE (conda or mamba, default: the one on PATH),
# MAX_JOBS (parallel compile jobs, default 8). The slurm templates take the same name in RL360_CONDA_ENV.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
env_name=${RL360_CONDA_ENV:-rl360}
max_jobs=${MAX_JOBS:-8}

die() {
  echo "launchers/conda/install.sh: $*" >&2
  exit 1
}

# launchers/versions.env, read as data (KEY=VALUE lines), never sourced: values such as CUDA_ARCHS=90;100 are not
# shell words.
declare -A pin=()
while IFS= read -r line || [[ -n "$line" ]]; do
  [[ -z "$line" || "$line" == \#* ]] && continue
  [[ "$line" == *=* ]] || die "launchers/versions.env: not KEY=VALUE: $line"
  pin[${line%%=*}]=${line#*=}
done < "$repo/launchers/versions.env"
for key in PYTHON_VERSION CUDA_VERSION TORCH_VERSION SGLANG_VERSION SGLANG_KERNEL_VERSION FLASHINFER_VERSION \
  TRANSFORMERS_VERSION RAY_VERSION MEGATRON_CORE_VERSION TRANSFORMER_ENGINE_VERSION TRANSFORMER_ENGINE_COMMIT \
  APEX_COMMIT PYBIND11_VERSION CUDA_ARCHS; do
  [[ -n "${pin[$key]:-}" ]] || die "launchers/versions.env has no $key"
done

conda_exe=${CONDA_EXE:-$(command -v conda || command -v mamba || true)}
[[ -n "$conda_exe" ]] || die "no conda on PATH (install Miniforge, or set CONDA_EXE)"
conda_base=$("$conda_exe" info --base)

if "$conda_exe" env list | awk '{print $1}' | grep -qx "$env_name"; then
  echo "updating conda environment $env_name from launchers/conda/environment.yml"
  "$conda_exe" env update -n "$env_name" -f "$here/environment.yml"
else
  echo "creating conda environment $env_name from launchers/conda/environment.yml"
  "$conda_exe" env create -n "$env_name" -f "$here/environment.yml"
fi

# conda's activation scripts read unset variables; `set -u` is lifted around them
set +u
# shellcheck source=/dev/null
source "$conda_base/etc/profile.d/conda.sh"
conda activate "$env_name"
set -u

python_version=$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[[ "$python_version" == "${pin[PYTHON_VERSION]}" ]] ||
  die "environment $env_name has Python $python_version, launchers/versions.env pins ${pin[PYTHON_VERSION]}"

# The pins as a pip constraints file inside the environment; PIP_CONSTRAINT holds every later pip install in it
# (here and after activation) to them, as the container image does.
constraints="$CONDA_PREFIX/etc/rl360-constraints.txt"
mkdir -p "$CONDA_PREFIX/etc"
printf '%s\n' \
  "torch==${pin[TORCH_VERSION]}" \
  "sglang==${pin[SGLANG_VERSION]}" \
  "sglang-kernel==${pin[SGLANG_KERNEL_VERSION]}" \
  "flashinfer-python==${pin[FLASHINFER_VERSION]}" \
  "transformers==${pin[TRANSFORMERS_VERSION]}" \
  "ray==${pin[RAY_VERSION]}" \
  "megatron-core==${pin[MEGATRON_CORE_VERSION]}" \
  "transformer-engine==${pin[TRANSFORMER_ENGINE_VERSION]}" \
  "pybind11==${pin[PYBIND11_VERSION]}" \
  > "$constraints"
export PIP_CONSTRAINT="$constraints"

# Build against the environment's CUDA toolkit; conda-forge keeps its headers under targets/.
export CUDA_HOME="$CONDA_PREFIX"
export CPATH="$CONDA_PREFIX/targets/x86_64-linux/include${CPATH:+:$CPATH}"
nvcc --version | grep -q "release ${pin[CUDA_VERSION]}," ||
  die "nvcc in $env_name is not CUDA ${pin[CUDA_VERSION]}: $(nvcc --version | tail -n 1)"
# cuDNN comes with torch's wheels (nvidia-cudnn-cu13); Transformer Engine compiles against that copy
CUDNN_PATH=$(python -c 'import nvidia.cudnn; print(list(nvidia.cudnn.__path__)[0])')
export CUDNN_PATH

echo "building Transformer Engine ${pin[TRANSFORMER_ENGINE_VERSION]} (${pin[TRANSFORMER_ENGINE_COMMIT]})"
NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS="${pin[CUDA_ARCHS]}" MAX_JOBS="$max_jobs" NVTE_BUILD_THREADS_PER_JOB=2 \
  python -m pip install --no-build-isolation \
  "transformer_engine @ git+https://github.com/NVIDIA/TransformerEngine.git@${pin[TRANSFORMER_ENGINE_COMMIT]}"

echo "building Apex ${pin[APEX_COMMIT]}"
torch_archs=$(sed -E 's/([0-9]+)([0-9])/\1.\2/g' <<< "${pin[CUDA_ARCHS]}")
TORCH_CUDA_ARCH_LIST="$torch_archs" APEX_CPP_EXT=1 APEX_CUDA_EXT=1 MAX_JOBS="$max_jobs" NVCC_APPEND_FLAGS="--threads 4" \
  python -m pip install --no-build-isolation "apex @ git+https://github.com/NVIDIA/apex.git@${pin[APEX_COMMIT]}"

echo "installing rl360 from $repo"
python -m pip install -e "$repo"

# Every pinned package as installed (local labels such as +cu130 aside), as the image's last build step checks.
python - "$constraints" <<'EOF'
import importlib.metadata as md
import sys

from packaging.version import Version

pins = dict(line.split("==") for line in open(sys.argv[1]).read().split())
got = {name: Version(md.version(name)).public for name in pins}
bad = [f"{name}: pinned {want}, installed {got[name]}" for name, want in pins.items() if got[name] != want]
if bad:
    sys.exit("versions differ from launchers/versions.env:\n" + "\n".join(bad))
print("pins hold:", ", ".join(pins))
EOF

conda env config vars set -n "$env_name" PIP_CONSTRAINT="$constraints" > /dev/null
echo "done: conda activate $env_name (sbatch with RL360_CONDA_ENV=$env_name)"
