#!/usr/bin/env bash
# N JAX processes on this machine against a localhost coordinator: multi-process code paths
# (jax.distributed, per-process data sharding, process-0-only logging) without a cluster.
#
#   launch/local_multiprocess.sh N DEVICES_PER_PROCESS -- COMMAND [ARGS...]
#   launch/local_multiprocess.sh N DEVICES_PER_PROCESS -- --config configs/tiny.py --workdir /tmp/run
#
# After `--` comes either a command, or (if the first word starts with '-') arguments for
# `$PYTHON -m zaya_jax.train`. Each process i gets
#   ZAYA_COORDINATOR=127.0.0.1:PORT  ZAYA_NUM_PROCESSES=N  ZAYA_PROCESS_ID=i
# which zaya_jax.parallel.distributed.initialize_from_env turns into jax.distributed.initialize.
# Devices:
#   CPU (default without GPUs, or JAX_PLATFORMS=cpu): XLA_FLAGS gets
#       --xla_force_host_platform_device_count=DEVICES_PER_PROCESS (replacing any earlier value).
#   GPU: process i owns devices i*D .. i*D+D-1, through ZAYA_LOCAL_DEVICE_IDS (jax local_device_ids;
#       the default), or with ZAYA_DEVICE_SPLIT=visible through HIP_VISIBLE_DEVICES/CUDA_VISIBLE_DEVICES.
# Output lines are prefixed [pI]. The script waits for all processes; when one fails it kills the
# others (they would otherwise block in a collective or in distributed start-up) and exits with the
# first failure's exit code.
#
# Environment:
#   PYTHON                 interpreter for the `--config ...` form (default: python)
#   ZAYA_PORT              coordinator port (default: a free one)
#   ZAYA_LAUNCH_PLATFORM   cpu | gpu | auto (default auto: gpu if /dev/kfd or nvidia-smi works,
#                          unless JAX_PLATFORMS=cpu)
#   ZAYA_DEVICE_SPLIT      ids | visible (GPU only, default ids)
#   ZAYA_KILL_GRACE        seconds between SIGTERM and SIGKILL for the survivors (default 5)

set -uo pipefail

usage() {
  echo "usage: $0 N DEVICES_PER_PROCESS -- COMMAND [ARGS...] | -- --config CONFIG --workdir DIR [...]" >&2
  exit 2
}

(( $# >= 4 )) || usage
num_procs="$1"; devs_per_proc="$2"
[[ "$3" == "--" ]] || usage
shift 3
[[ "${num_procs}" =~ ^[1-9][0-9]*$ && "${devs_per_proc}" =~ ^[1-9][0-9]*$ ]] || usage

PYTHON="${PYTHON:-python}"
if [[ "$1" == -* ]]; then
  cmd=("${PYTHON}" -m zaya_jax.train "$@")
else
  cmd=("$@")
fi

# ---- coordinator port ----
port="${ZAYA_PORT:-}"
if [[ -z "${port}" ]]; then
  for py in "${PYTHON}" python3 python; do
    port="$("${py}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null)" && break
  done
  # No Python to ask: a random high port (a collision shows up as a start-up error, not a wrong run).
  [[ -n "${port}" ]] || port=$(( 20000 + RANDOM % 30000 ))
fi

# ---- platform ----
platform="${ZAYA_LAUNCH_PLATFORM:-auto}"
if [[ "${platform}" == auto ]]; then
  platform=cpu
  if [[ "${JAX_PLATFORMS:-}" != cpu ]]; then
    if [[ -e /dev/kfd ]] || { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; then
      platform=gpu
    fi
  fi
fi
[[ "${platform}" == cpu || "${platform}" == gpu ]] || { echo "ZAYA_LAUNCH_PLATFORM must be cpu, gpu or auto" >&2; exit 2; }

export ZAYA_COORDINATOR="127.0.0.1:${port}"
export ZAYA_NUM_PROCESSES="${num_procs}"
export PYTHONUNBUFFERED=1   # so the [pI] lines interleave as they happen
if [[ "${platform}" == cpu ]]; then
  export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
  xla_flags="$(printf '%s' "${XLA_FLAGS:-}" | sed -E 's/(^| )--xla_force_host_platform_device_count=[^ ]*//g')"
  export XLA_FLAGS="${xla_flags:+${xla_flags} }--xla_force_host_platform_device_count=${devs_per_proc}"
fi
echo "[launch] ${num_procs} processes x ${devs_per_proc} ${platform} devices, coordinator ${ZAYA_COORDINATOR}" >&2

pids=()
kill_all() {  # kill_all SIGNAL: every process group still running
  local pid
  for pid in "${pids[@]}"; do
    kill -0 "${pid}" 2>/dev/null && kill "-$1" -- "-${pid}" 2>/dev/null
  done
}
terminate() {  # TERM the survivors, then KILL after the grace period
  kill_all TERM
  local deadline=$(( SECONDS + ${ZAYA_KILL_GRACE:-5} )) pid alive
  while (( SECONDS < deadline )); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "${pid}" 2>/dev/null && alive=1; done
    (( alive )) || return 0
    sleep 0.1
  done
  kill_all KILL
}
trap 'echo "[launch] interrupted, stopping all processes" >&2; terminate; exit 130' INT TERM

for (( i = 0; i < num_procs; i++ )); do
  env_i=(ZAYA_PROCESS_ID="${i}")
  if [[ "${platform}" == gpu ]]; then
    ids="$(seq -s, $(( i * devs_per_proc )) $(( (i + 1) * devs_per_proc - 1 )))"
    if [[ "${ZAYA_DEVICE_SPLIT:-ids}" == visible ]]; then
      env_i+=(HIP_VISIBLE_DEVICES="${ids}" CUDA_VISIBLE_DEVICES="${ids}")
    else
      env_i+=(ZAYA_LOCAL_DEVICE_IDS="${ids}")
    fi
  fi
  # setsid: each process (with its prefixing awk) in its own process group, so one kill reaches
  # everything it started. pipefail: the group's exit status is the command's, not awk's.
  env "${env_i[@]}" setsid bash -c '
    set -o pipefail
    prefix="$1"; shift
    "$@" 2>&1 | awk -v p="${prefix}" "{ print p \$0; fflush() }"
  ' _ "[p${i}] " "${cmd[@]}" &
  pids+=($!)
done

# ---- wait: first failure wins, the rest are stopped ----
first_rc=0
remaining=("${pids[@]}")
while (( ${#remaining[@]} )); do
  still=()
  for idx in "${!remaining[@]}"; do
    pid="${remaining[idx]}"
    if kill -0 "${pid}" 2>/dev/null; then
      still+=("${pid}")
      continue
    fi
    wait "${pid}"; rc=$?
    if (( rc != 0 && first_rc == 0 )); then
      first_rc=${rc}
      for p in "${!pids[@]}"; do [[ "${pids[p]}" == "${pid}" ]] && who=${p}; done
      echo "[launch] process ${who} exited with ${rc}; stopping the others" >&2
      terminate
    fi
  done
  remaining=("${still[@]+"${still[@]}"}")
  (( ${#remaining[@]} )) && sleep 0.1
done
exit "${first_rc}"
