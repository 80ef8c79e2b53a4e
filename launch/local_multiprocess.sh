#!/usr/bin/env bash
# Rehearse a multi-host run on one machine: N JAX processes on 127.0.0.1, each with
# D fake CPU devices, connected over gloo. Arguments after the counts go to rlhf_jax.main.
#
#   launch/local_multiprocess.sh 2 4 --config=configs/grpo.py --config.mesh.data=-1
# If a process dies, the others stop ("another task died") after RLHF_JAX_HEARTBEAT_TIMEOUT_S seconds
# (default 100) instead of waiting in a collective; export a smaller value to fail faster.
set -euo pipefail
num_processes=${1:?number of processes}; devices=${2:?devices per process}; shift 2
port=${RLHF_JAX_PORT:-12355}
# XLA flags already exported are kept (dumps, collective timeouts, ...), but for the device count given here.
xla_flags="$(printf '%s' "${XLA_FLAGS:-}" | sed -E 's/--xla_force_host_platform_device_count=[0-9]+//g')"
pids=()
for ((i = 0; i < num_processes; i++)); do
  JAX_PLATFORMS=cpu XLA_FLAGS="${xla_flags} --xla_force_host_platform_device_count=${devices}" \
  RLHF_JAX_COORDINATOR="127.0.0.1:${port}" RLHF_JAX_NUM_PROCESSES="${num_processes}" RLHF_JAX_PROCESS_ID="$i" \
    python -m rlhf_jax.main "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
