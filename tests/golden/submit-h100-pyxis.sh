#!/bin/bash

# Parameters
#SBATCH --comment=aura_hpc
#SBATCH --cpus-per-task=14
#SBATCH --distribution=block:block
#SBATCH --error=/shared/aura/runs/gpt2/slurm/%j_0_log.err
#SBATCH --exclusive
#SBATCH --gpus-per-node=8
#SBATCH --job-name=aura-gpt2
#SBATCH --mem=0
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --open-mode=append
#SBATCH --output=/shared/aura/runs/gpt2/slurm/%j_0_log.out
#SBATCH --requeue
#SBATCH --signal=USR2@120
#SBATCH --time=1440

# setup
export AURA_RUN_DIR=/shared/aura/runs/gpt2
export PYTHONUNBUFFERED=1
# cluster profile: REPO/sbatch_templates/h100-pyxis.sh
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
export NCCL_IB_HCA=mlx5
export MELLANOX_VISIBLE_DEVICES=all
export NCCL_DEBUG=WARN
export TORCH_NCCL_ASYNC_ERROR_HANDLING=3
export TORCH_NCCL_DUMP_ON_TIMEOUT=1

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /shared/aura/runs/gpt2/slurm/%j_%t_log.out --error /shared/aura/runs/gpt2/slurm/%j_%t_log.err --kill-on-bad-exit=1 --open-mode=append --cpus-per-task=14 '--container-image=registry.example.org#aura/aura-hpc:latest' --container-mounts=/shared/aura/runs:/shared/aura/runs --container-workdir=/shared/aura/runs python3 -u -m submitit.core._submit /shared/aura/runs/gpt2/slurm

