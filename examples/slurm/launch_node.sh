#!/usr/bin/env bash
# One node's share of a multi-node run: `accelkit launch` with this node's --machine_rank.
#
# srun runs it once per node (see train.sbatch). It reads SLURM_NNODES and SLURM_NODEID, which
# SLURM sets, and MAIN_PROCESS_IP, MAIN_PROCESS_PORT and PROCS_PER_NODE, which train.sbatch sets.
# LAUNCH_FLAGS (default --multi_gpu) picks the device: LAUNCH_FLAGS=--cpu runs on CPUs with gloo.
# Everything after the options is the training script and its arguments.
set -euo pipefail

: "${SLURM_NNODES:?not set: run this through srun (see train.sbatch)}"
: "${SLURM_NODEID:?not set: run this through srun (see train.sbatch)}"
: "${MAIN_PROCESS_IP:?not set: the address of the first node (see train.sbatch)}"
MAIN_PROCESS_PORT=${MAIN_PROCESS_PORT:-29500}
PROCS_PER_NODE=${PROCS_PER_NODE:-1}
ACCELKIT=${ACCELKIT:-accelkit}

# shellcheck disable=SC2086  # LAUNCH_FLAGS may hold several flags
exec "$ACCELKIT" launch ${LAUNCH_FLAGS:---multi_gpu} \
  --num_machines "$SLURM_NNODES" \
  --machine_rank "$SLURM_NODEID" \
  --num_processes $((SLURM_NNODES * PROCS_PER_NODE)) \
  --main_process_ip "$MAIN_PROCESS_IP" \
  --main_process_port "$MAIN_PROCESS_PORT" \
  "$@"
