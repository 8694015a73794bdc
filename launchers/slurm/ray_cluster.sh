#!/usr/bin/env bash
# Bring up Ray over the nodes of a Slurm allocation, run one command on the head node, tear everything down.
#
#   launchers/slurm/ray_cluster.sh -- rl360 train CONFIG [key=value ...]
#
# Every template in launchers/slurm/ ends with it. Steps, each logged to $RL360_LOG_DIR/<node>.log:
#   1. the variables the template requires (RL360_REQUIRED_ENV) are checked, and the environment: a container
#      image (RL360_CONTAINER_IMAGE, run through pyxis/enroot), a conda environment (RL360_CONDA_ENV) or a
#      virtualenv (RL360_VENV, a directory every node sees);
#   2. stale Ray sessions are stopped on every node; the head starts on the first node, on the address its name
#      resolves to there (never a loopback one), and must answer `ray status` within RL360_READY_TIMEOUT_S;
#   3. every other node starts a worker on its own address (each retries a failed join up to 5 times);
#   4. `python -m rl360.cluster.ready` waits until every node has joined with its GPUs, or names those that have
#      not and the job ends;
#   5. the command runs on the head with RAY_ADDRESS set; its exit status is the job's, unless a node's Ray
#      exits first (the node died or lost its Ray): then the job ends at once with status 1, naming the node;
#   6. on exit, failure or signal: `ray stop` on every node and the background steps are killed.
#
# Stopping: SIGUSR1 to this script (Slurm's warning, `#SBATCH --signal=B:USR1@300`) is passed on to the command,
# which stops at its next safe point with a checkpoint and exit status 75 (`rl360 train`); the job is then
# requeued (`scontrol requeue`, after the teardown), and the requeued job runs the same command, which resumes.
# SIGTERM or SIGINT here (Slurm signals every process of the job at a time limit, a preemption or `scancel`, the
# command included) waits for the command to end rather than tearing Ray down under it, and never requeues.
#
# Settings (environment): RL360_NODES (default: the allocation's nodes), RL360_GPUS_PER_NODE (default:
# SLURM_GPUS_ON_NODE, else 8), RL360_CPUS_PER_NODE (the CPUs Ray may place work on; default SLURM_CPUS_ON_NODE,
# else all it finds), RL360_RAY_PORT (6379), RL360_RAY_DASHBOARD_PORT (8265), RL360_READY_TIMEOUT_S
# (600), RL360_LOG_DIR (logs/rl360-<job id>), RL360_ON_NODE (how to run a command on one node, "{node}" standing
# for its name; default `srun --nodes=1 --ntasks=1 --overlap -w {node}` plus the container options),
# RL360_CONTAINER_MOUNTS (pyxis mounts; default: the submit directory), RL360_VENV (a virtualenv every node
# activates), RL360_CONDA_SH (conda's profile script, default from `conda info --base`), RL360_REQUEUE (1: requeue
# the job after a stop on SIGUSR1; 0: do not), RL360_DRY_RUN=1 (print
# every command instead of running it: what `rl360 launch --print` shows). tests/test_multihost.py runs it over
# three network namespaces as nodes (RL360_ON_NODE: tests/netns_cluster.py's runner).
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
if [[ -n "${RL360_VENV:-}" && -n "${RL360_CONTAINER_IMAGE:-}${RL360_CONDA_ENV:-}" ]]; then
  die "set one of RL360_CONTAINER_IMAGE, RL360_CONDA_ENV and RL360_VENV"
fi
if [[ -z "${RL360_CONTAINER_IMAGE:-}${RL360_CONDA_ENV:-}${RL360_VENV:-}${RL360_ON_NODE:-}" ]]; then
  die "set RL360_CONTAINER_IMAGE (a pyxis/enroot image, see docker/README.md), RL360_CONDA_ENV (see" \
    "launchers/conda) or RL360_VENV (a virtualenv every node sees)"
fi

if [[ -n "${RL360_NODES:-}" ]]; then
  read -r -a nodes <<< "$RL360_NODES"
else
  [[ -n "${SLURM_JOB_NODELIST:-}" ]] || die "not inside a Slurm allocation (no SLURM_JOB_NODELIST); sbatch a template"
  mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
fi
head_node=${nodes[0]}
gpus=${RL360_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
cpus=${RL360_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-}}
port=${RL360_RAY_PORT:-6379}
dashboard_port=${RL360_RAY_DASHBOARD_PORT:-8265}
timeout_s=${RL360_READY_TIMEOUT_S:-600}
log_dir=${RL360_LOG_DIR:-logs/rl360-${SLURM_JOB_ID:-$$}}
mkdir -p "$log_dir"

# Ray's token authentication (Ray 2.5x turns it on for a cluster whose head finds ~/.ray/auth_token; every `ray`
# command and driver must then present the token, or `ray status` is refused): one token for the job, in the
# environment that every node's commands inherit (srun passes it on), never on a command line or in a log.
# RAY_AUTH_MODE=disabled turns it off; a RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH of your own is used as it is.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
if [[ "$RAY_AUTH_MODE" == token && -z "${RAY_AUTH_TOKEN:-}${RAY_AUTH_TOKEN_PATH:-}" ]]; then
  RAY_AUTH_TOKEN=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
  export RAY_AUTH_TOKEN
fi

# the shell prefix each node runs before a command: the conda environment or virtualenv, or nothing (the
# container has it)
setup=""
if [[ -n "${RL360_CONDA_ENV:-}" ]]; then
  conda_sh=${RL360_CONDA_SH:-}
  if [[ -z "$conda_sh" ]]; then
    if conda_base=$(conda info --base 2>/dev/null); then
      conda_sh=$conda_base/etc/profile.d/conda.sh
    elif [[ "$dry_run" == 1 ]]; then
      conda_sh="<conda>/etc/profile.d/conda.sh"
    else
      die "RL360_CONDA_ENV=$RL360_CONDA_ENV, but conda is not on PATH on $(hostname); set RL360_CONDA_SH to" \
        "<conda>/etc/profile.d/conda.sh"
    fi
  fi
  printf -v setup 'source %q && conda activate %q && ' "$conda_sh" "$RL360_CONDA_ENV"
elif [[ -n "${RL360_VENV:-}" ]]; then
  printf -v setup 'source %q/bin/activate && ' "$RL360_VENV"
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
declare -A node_of=()  # the node each background Ray process runs on, by its pid here
spawn() {
  if [[ "$dry_run" == 1 ]]; then run_on "$1" "$2"; return 0; fi
  run_on "$1" "$2" >> "$log_dir/$1.log" 2>&1 &
  background+=($!)
  node_of[$!]=$1
}

# address_of NODE: the address NODE's name resolves to on NODE, skipping loopback ones (Debian's hosts file
# maps the host name to 127.0.1.1), else NODE's first address; the one Ray serves on and the others reach
address_of() {
  if [[ "$dry_run" == 1 ]]; then echo "<address of $1>"; return 0; fi
  local word
  for word in $(run_on "$1" "hostname --ip-address; hostname --all-ip-addresses"); do
    if [[ "$word" != 127.* && "$word" != ::1 ]]; then echo "$word"; return 0; fi
  done
  die "could not read a non-loopback address of $1"
}

any_alive() {
  local pid
  for pid in "$@"; do kill -0 "$pid" 2>/dev/null && return 0; done
  return 1
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
  local stop_deadline=$((SECONDS + 60))  # a node that does not answer does not hold the job
  while any_alive "${stoppers[@]}" && (( SECONDS < stop_deadline )); do sleep 0.5; done
  kill "${stoppers[@]}" 2>/dev/null || true
  wait "${stoppers[@]}" 2>/dev/null || true
  for pid in "${background[@]}"; do kill "$pid" 2>/dev/null || true; done
  if (( ${requeue:-0} )); then  # stopped on the time-limit warning: the same job again, which resumes
    echo "rl360 launch: requeueing job $SLURM_JOB_ID; it runs the same command again, which resumes" >&2
    scontrol requeue "$SLURM_JOB_ID" || echo "rl360 launch: scontrol requeue $SLURM_JOB_ID failed" >&2
  fi
  exit "$status"
}
trap teardown EXIT INT TERM

# the warning before the bring-up is done: no command to stop; the job is requeued once up, without running it
warned=0
trap 'warned=1' USR1

# ---- 2. the head ---------------------------------------------------------------------------------------------
head_address=$(address_of "$head_node")
address="$head_address:$port"
echo "rl360 launch: ${#nodes[@]} node(s) x $gpus GPU(s); ray head on $head_node ($address); logs in $log_dir" >&2

start_head="ray stop --force >/dev/null 2>&1; ray start --head --node-ip-address=$head_address --port=$port"
start_head+=" --dashboard-host=0.0.0.0 --dashboard-port=$dashboard_port --num-gpus=$gpus${cpus:+ --num-cpus=$cpus}"
start_head+=" --block"
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
# a join that failed is tried again; a worker that had joined and then stopped is a lost node, and ends (the job
# ends with it, below), never joining again as a new node under the run's feet
for node in "${nodes[@]:1}"; do
  join="ray stop --force >/dev/null 2>&1; for attempt in 1 2 3 4 5; do joined=\$(ray start --address=$address"
  join+=" --node-ip-address=$(address_of "$node") --num-gpus=$gpus${cpus:+ --num-cpus=$cpus} --block 2>&1"
  join+=" | tee /dev/stderr | grep -c 'Ray runtime started'); (( joined )) && exit 1; sleep 10; done; exit 1"
  spawn "$node" "$join"
done

# ---- 4. every node joined with its GPUs ------------------------------------------------------------------------
node_list=$(IFS=,; echo "${nodes[*]}")
remaining=$((deadline - SECONDS))
run_on "$head_node" "python -m rl360.cluster.ready --address=$address --nodes=$node_list --gpus-per-node=$gpus \
--timeout=$(( remaining > 30 ? remaining : 30 ))" || die "the cluster did not come up; see $log_dir/"

# ---- 5. the command ------------------------------------------------------------------------------------------
printf -v command '%q ' "$@"
stopped_status=75  # `rl360 train` stopped by a signal after its checkpoint (rl360.errors.STOPPED_EXIT)
# warned: SIGUSR1 came (above): the job's time runs out, and it is requeued once the command has stopped
signalled=0        # SIGTERM or SIGINT came: the command got it too; wait for it, then tear down
requeue=0

# a node whose Ray exits (the node died, or its raylet did) ends the job at once, named: the run cannot go on
# without it, and must not wait on it
end_if_a_node_is_lost() {
  local pid status
  for pid in "${!node_of[@]}"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      wait "$pid" && status=0 || status=$?
      die "the ray node on ${node_of[$pid]} exited (status $status) $1: node ${node_of[$pid]} is down or lost" \
        "its Ray; see $log_dir/${node_of[$pid]}.log"
    fi
  done
}

# the command on the head (exec'd, so a signal sent to srun reaches it); its exit status is the job's, unless a
# node is lost first
run_command() {
  if [[ "$dry_run" == 1 ]]; then run_on "$head_node" "exec env RAY_ADDRESS=$address $command"; return 0; fi
  # started here, not through run_on in the background (a subshell): $! is then srun itself, which passes a
  # signal on to its task
  local -a prefix
  read -r -a prefix <<< "${on_node//\{node\}/$head_node}"
  "${prefix[@]}" bash -lc "cd $PWD && ${setup}exec env RAY_ADDRESS=$address $command" &
  command_pid=$!
  local status=0
  background+=("$command_pid")
  trap 'warned=1; echo "rl360 launch: SIGUSR1: the job is near its time limit; stopping the command" >&2
        kill -USR1 "$command_pid" 2>/dev/null || true' USR1
  trap 'signalled=1' TERM INT
  while kill -0 "$command_pid" 2>/dev/null; do
    (( signalled )) || end_if_a_node_is_lost "while the job ran"
    sleep 2 & wait $! || true  # a trap runs at once, not after the sleep
  done
  wait "$command_pid" || status=$?
  while (( status > 128 )) && kill -0 "$command_pid" 2>/dev/null; do  # the wait was cut by a trap
    wait "$command_pid" && status=0 || status=$?
  done
  trap '' USR1  # the command has ended: a late warning changes nothing
  if (( status == stopped_status && warned )) && [[ "${RL360_REQUEUE:-1}" == 1 && -n "${SLURM_JOB_ID:-}" ]]; then
    requeue=1
  fi
  if (( status != 0 && status != stopped_status && ! signalled )); then
    sleep 5  # a failure from a lost node can reach the command before the node's `ray start --block` has ended
    end_if_a_node_is_lost "and the job failed (status $status)"
  fi
  return "$status"
}
if (( warned )) && [[ "$dry_run" != 1 ]]; then
  echo "rl360 launch: SIGUSR1 before the command started: not starting it" >&2
  [[ "${RL360_REQUEUE:-1}" == 1 && -n "${SLURM_JOB_ID:-}" ]] && requeue=1
  exit "$stopped_status"
fi
run_command
