#!/bin/bash
# aura_hpc cluster profile "generic": any Slurm cluster, CPU or GPU nodes, plain Ethernet.
# Copy this file, edit it, and pass it with --cluster /path/to/your-profile.sh.
#
# Lines read by aura_hpc:
#   #SBATCH --option=value   defaults for the job (the config's slurm section and CLI flags win)
#   #AURA key=value          aura_hpc settings: output_dir (shared by all nodes), max_gpus_per_node,
#                            gpu_mem_gib (the memory plan refuses a job that cannot fit),
#                            screen_gemm_tflops, screen_allreduce_gbps, screen_inter_gbps (--screen;
#                            without them, as here, nodes are judged against each other only)
#   anything else            runs in the job script before the trainer (modules, venv, exports)
#SBATCH --time=01:00:00

# How many threads each rank's PyTorch uses: one per CPU Slurm gave the task.
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
# NCCL prints warnings only; `submit --nccl-debug` switches to INFO with a file per host.
export NCCL_DEBUG=WARN
# A failed or hung collective tears the job down (and Slurm can requeue) instead of hanging: 3, torch's
# default, ends the process at once; 1 and 2 first abort NCCL's communicators, which can hang themselves.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=3
