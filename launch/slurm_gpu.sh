#!/usr/bin/env bash
# One process per node on a SLURM GPU cluster (jax.distributed reads the SLURM environment):
#
#   sbatch --nodes=2 --ntasks-per-node=1 --gpus-per-node=8 launch/slurm_gpu.sh --config=configs/ppo.py ...
#SBATCH --job-name=rlhf_jax
# If a process dies, the others stop ("another task died") after RLHF_JAX_HEARTBEAT_TIMEOUT_S seconds
# (default 100) instead of waiting in a collective; export a smaller value to fail faster.
# Modes: a run of several processes (this script) uses the colocated layout: every device samples and trains, in
# turn. Separate rollout devices (mesh.rollout_devices=K) and overlapped sampling (experience.overlap=True) run in
# one process over its local devices, e.g. one host of 8 accelerators started with plain `python -m rlhf_jax.main
# ... --config.mesh.rollout_devices=4 --config.experience.overlap=True`.
set -euo pipefail
export RLHF_JAX_DISTRIBUTED=auto
srun python -m rlhf_jax.main "$@"
