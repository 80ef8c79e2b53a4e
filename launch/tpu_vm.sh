#!/usr/bin/env bash
# Run on every worker of a TPU VM slice (jax.distributed detects the slice itself):
#
#   gcloud compute tpus tpu-vm ssh NAME --worker=all --command \
#     "cd rlhf_jax && RLHF_JAX_DISTRIBUTED=auto bash launch/tpu_vm.sh --config=configs/grpo.py ..."
# If a process dies, the others stop ("another task died") after RLHF_JAX_HEARTBEAT_TIMEOUT_S seconds
# (default 100) instead of waiting in a collective; export a smaller value to fail faster.
# Modes: a run of several processes (this script) uses the colocated layout: every device samples and trains, in
# turn. Separate rollout devices (mesh.rollout_devices=K) and overlapped sampling (experience.overlap=True) run in
# one process over its local devices, e.g. one host of 8 accelerators started with plain `python -m rlhf_jax.main
# ... --config.mesh.rollout_devices=4 --config.experience.overlap=True`.
# Sampling on hosts of their own: add --config.mesh.rollout_processes=k --config.experience.overlap=True to this
# script's arguments; the last k workers of the slice (by worker index: `--worker=N-k..N-1`)
# sample, the others train (process 0 always trains), and each process prints one line saying which it does.
# Weights and batches move device to device between the two groups (docs/placement.md); every process watches the
# others, so one that dies or stalls stops the run within 0.4 x RLHF_JAX_HEARTBEAT_TIMEOUT_S with one line naming
# it, and the same command resumes from the last checkpoint.
set -euo pipefail
export RLHF_JAX_DISTRIBUTED=${RLHF_JAX_DISTRIBUTED:-auto}
exec python -m rlhf_jax.main "$@"
