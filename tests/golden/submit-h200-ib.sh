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
# cluster profile: REPO/sbatch_templates/h200-ib.sh
if command -v module >/dev/null 2>&1; then
  module purge
  module load cuda/12.6 || echo "aura_hpc: module cuda/12.6 is not available on $(hostname) (fix: change the module line of the cluster profile)" >&2
else
  echo "aura_hpc: no 'module' command on $(hostname); the profile's module lines were skipped" >&2
fi
if [ -f "${AURA_VENV:-$HOME/venvs/aura}/bin/activate" ]; then source "${AURA_VENV:-$HOME/venvs/aura}/bin/activate"; fi
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
export NCCL_IB_HCA=mlx5
export NCCL_DEBUG=WARN
export TORCH_NCCL_ASYNC_ERROR_HANDLING=3
export TORCH_NCCL_DUMP_ON_TIMEOUT=1

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /shared/aura/runs/gpt2/slurm/%j_%t_log.out --error /shared/aura/runs/gpt2/slurm/%j_%t_log.err --kill-on-bad-exit=1 --open-mode=append --cpus-per-task=14 PYTHON -u -m submitit.core._submit /shared/aura/runs/gpt2/slurm

