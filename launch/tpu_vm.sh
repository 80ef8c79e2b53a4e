#!/usr/bin/env bash
# Run on every worker of a TPU VM slice (jax.distributed detects the slice itself):
#
#   gcloud compute tpus tpu-vm ssh NAME --worker=all --command \
#     "cd rlhf_jax && RLHF_JAX_DISTRIBUTED=auto bash launch/tpu_vm.sh --config=configs/grpo.py ..."
set -euo pipefail
export RLHF_JAX_DISTRIBUTED=${RLHF_JAX_DISTRIBUTED:-auto}
exec python -m rlhf_jax.main "$@"
