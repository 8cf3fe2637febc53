#!/bin/bash

# Parameters
#SBATCH --comment=aura_hpc
#SBATCH --error=/shared/aura/runs/gpt2/slurm/%j_0_log.err
#SBATCH --job-name=aura-gpt2
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=/shared/aura/runs/gpt2/slurm/%j_0_log.out
#SBATCH --requeue
#SBATCH --signal=USR2@120
#SBATCH --time=60

# setup
export AURA_RUN_DIR=/shared/aura/runs/gpt2
export PYTHONUNBUFFERED=1
# cluster profile: REPO/sbatch_templates/generic.sh
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
export NCCL_DEBUG=WARN
export TORCH_NCCL_ASYNC_ERROR_HANDLING=3

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /shared/aura/runs/gpt2/slurm/%j_%t_log.out --error /shared/aura/runs/gpt2/slurm/%j_%t_log.err --kill-on-bad-exit=1 --open-mode=append PYTHON -u -m submitit.core._submit /shared/aura/runs/gpt2/slurm

