#!/usr/bin/env bash
# Bring up Ray over the nodes of a Slurm allocation, run one command on the head node, tear everything down.
#
#   launchers/slurm/ray_cluster.sh -- rl360 train CONFIG [key=value ...]
#
# Every template in launchers/slurm/ ends with it. Steps, each logged to $RL360_LOG_DIR/<node>.log:
#   1. the variables the template requires (RL360_REQUIRED_ENV) are checked, and the environment: a container
#      image (RL360_CONTAINER_IMAGE, run through pyxis/enroot) or a conda environment (RL360_CONDA_ENV);
#   2. stale Ray sessions are stopped on every node; the head starts on the first node and must answer
#      `ray status` within RL360_READY_TIMEOUT_S;
#   3. every other node starts a worker (each retries its join up to 5 times);
#   4. `python -m rl360.cluster.ready` waits until every node has joined with its GPUs, or names those that have
#      not and the job ends;
#   5. the command runs on the head with RAY_ADDRESS set; its exit status is the job's;
#   6. on exit, failure or signal: `ray stop` on every node and the background steps are killed.
#
# Settings (environment): RL360_NODES (default: the allocation's nodes), RL360_GPUS_PER_NODE (default:
# SLURM_GPUS_ON_NODE, else 8), RL360_RAY_PORT (6379), RL360_RAY_DASHBOARD_PORT (8265), RL360_READY_TIMEOUT_S
# (600), RL360_LOG_DIR (logs/rl360-<job id>), RL360_ON_NODE (how to run a command on one node, "{node}" standing
# for its name; default `srun --nodes=1 --ntasks=1 --overlap -w {node}` plus the container options),
# RL360_CONTAINER_MOUNTS (pyxis mounts; default: the submit directory), RL360_CONDA_SH (conda's profile script,
# default from `conda info --base`), RL360_DRY_RUN=1 (print every command instead of running it: what
# `rl360 launch --print` shows).
set -euo pipefail

if [[ "${1:-}" == "--" ]]; then shift; fi
if [[ $# -eq 0 ]]; then
  echo "usage: $0 -- COMMAND [ARGS...]   (run inside a Slurm allocation)" >&2
  exit 2
fi

dry_run=${RL360_DRY_RUN:-0}
die() { echo "rl360 launch: $*" >&2; exit 1; }

# ---- 1. what the run needs, checked before anything starts -------------------------------------------------
for name in ${RL360_REQUIRED_ENV:-}; do
  [[ -n "${!name:-}" ]] || die "$name is not set (this template needs: ${RL360_REQUIRED_ENV})"
  if [[ "$name" == *_PATH || "$name" == *_DIR ]] && [[ "$dry_run" != 1 ]] && [[ ! -e "${!name}" ]]; then
    die "$name=${!name} does not exist on $(hostname)"
  fi
done
if [[ -n "${RL360_CONTAINER_IMAGE:-}" && -n "${RL360_CONDA_ENV:-}" ]]; then
  die "set RL360_CONTAINER_IMAGE or RL360_CONDA_ENV, not both"
fi
if [[ -z "${RL360_CONTAINER_IMAGE:-}" && -z "${RL360_CONDA_ENV:-}" && -z "${RL360_ON_NODE:-}" ]]; then
  die "set RL360_CONTAINER_IMAGE (a pyxis/enroot image, see docker/README.md) or RL360_CONDA_ENV (see launchers/conda)"
fi

if [[ -n "${RL360_NODES:-}" ]]; then
  read -r -a nodes <<< "$RL360_NODES"
else
  [[ -n "${SLURM_JOB_NODELIST:-}" ]] || die "not inside a Slurm allocation (no SLURM_JOB_NODELIST); sbatch a template"
  mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
fi
head_node=${nodes[0]}
gpus=${RL360_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
port=${RL360_RAY_PORT:-6379}
dashboard_port=${RL360_RAY_DASHBOARD_PORT:-8265}
timeout_s=${RL360_READY_TIMEOUT_S:-600}
log_dir=${RL360_LOG_DIR:-logs/rl360-${SLURM_JOB_ID:-$$}}
mkdir -p "$log_dir"

# the shell prefix each node runs before a command: the conda environment, or nothing (the container has it)
setup=""
if [[ -n "${RL360_CONDA_ENV:-}" ]]; then
  conda_sh=${RL360_CONDA_SH:-$(conda info --base 2>/dev/null)/etc/profile.d/conda.sh}
  printf -v setup 'source %q && conda activate %q && ' "$conda_sh" "$RL360_CONDA_ENV"
fi
on_node=${RL360_ON_NODE:-"srun --nodes=1 --ntasks=1 --overlap -w {node}"}
if [[ -n "${RL360_CONTAINER_IMAGE:-}" && -z "${RL360_ON_NODE:-}" ]]; then
  on_node+=" --container-image=${RL360_CONTAINER_IMAGE} --container-mounts=${RL360_CONTAINER_MOUNTS:-$PWD:$PWD}"
  on_node+=" --container-workdir=$PWD"
fi

# run_on NODE COMMAND: COMMAND (one string) in a login shell on NODE, from this directory
run_on() {
  local node=$1 command=$2
  local -a prefix
  read -r -a prefix <<< "${on_node//\{node\}/$node}"
  if [[ "$dry_run" == 1 ]]; then
    local line="cd $PWD && ${setup}${command}"
    printf "%s bash -lc '%s'\n" "${prefix[*]}" "${line//\'/\'\\\'\'}"
    return 0
  fi
  "${prefix[@]}" bash -lc "cd $PWD && ${setup}${command}"
}

# spawn NODE COMMAND: run_on in the background, its output in the node's log (dry run: printed, in order)
background=()
spawn() {
  if [[ "$dry_run" == 1 ]]; then run_on "$1" "$2"; return 0; fi
  run_on "$1" "$2" >> "$log_dir/$1.log" 2>&1 &
  background+=($!)
}

teardown() {
  local status=$?
  trap - EXIT INT TERM
  [[ "$dry_run" == 1 ]] && exit "$status"
  echo "rl360 launch: stopping ray on ${#nodes[@]} node(s)" >&2
  local -a stoppers=()
  for node in "${nodes[@]}"; do
    run_on "$node" "ray stop --force" >> "$log_dir/$node.log" 2>&1 &
    stoppers+=($!)
  done
  ( sleep 60; kill "${stoppers[@]}" 2>/dev/null ) &  # a node that does not answer does not hold the job
  local watchdog=$!
  wait "${stoppers[@]}" 2>/dev/null || true
  kill "$watchdog" 2>/dev/null || true
  for pid in "${background[@]}"; do kill "$pid" 2>/dev/null || true; done
  exit "$status"
}
trap teardown EXIT INT TERM

# ---- 2. the head ---------------------------------------------------------------------------------------------
if [[ "$dry_run" == 1 ]]; then
  head_address="<address of $head_node>"
else
  head_address=$(run_on "$head_node" "hostname --ip-address" | awk '{print $1}')
  [[ -n "$head_address" ]] || die "could not read the address of $head_node"
fi
address="$head_address:$port"
echo "rl360 launch: ${#nodes[@]} node(s) x $gpus GPU(s); ray head on $head_node ($address); logs in $log_dir" >&2

start_head="ray stop --force >/dev/null 2>&1; ray start --head --node-ip-address=$head_address --port=$port"
start_head+=" --dashboard-host=0.0.0.0 --dashboard-port=$dashboard_port --num-gpus=$gpus --block"
spawn "$head_node" "$start_head"

deadline=$((SECONDS + timeout_s))
until [[ "$dry_run" == 1 ]] || run_on "$head_node" "ray status --address=$address" > /dev/null 2>&1; do
  if (( SECONDS > deadline )); then
    die "the ray head on $head_node did not answer within ${timeout_s} s; see $log_dir/$head_node.log"
  fi
  kill -0 "${background[0]}" 2>/dev/null || die "the ray head on $head_node exited; see $log_dir/$head_node.log"
  sleep 3
done

# ---- 3. the workers ------------------------------------------------------------------------------------------
join="ray stop --force >/dev/null 2>&1; for attempt in 1 2 3 4 5; do"
join+=" ray start --address=$address --num-gpus=$gpus --block && exit 0; sleep 10; done; exit 1"
for node in "${nodes[@]:1}"; do
  spawn "$node" "$join"
done

# ---- 4. every node joined with its GPUs ------------------------------------------------------------------------
node_list=$(IFS=,; echo "${nodes[*]}")
remaining=$((deadline - SECONDS))
run_on "$head_node" "python -m rl360.cluster.ready --address=$address --nodes=$node_list --gpus-per-node=$gpus \
--timeout=$(( remaining > 30 ? remaining : 30 ))" || die "the cluster did not come up; see $log_dir/"

# ---- 5. the command ------------------------------------------------------------------------------------------
printf -v command '%q ' "$@"
run_on "$head_node" "RAY_ADDRESS=$address $command"
