#!/bin/bash
# aura_hpc cluster profile "h100-pyxis": 8x H100 nodes with InfiniBand where Slurm starts each
# task in a container (NVIDIA Pyxis + Enroot: srun --container-image). The image is the
# repository's Dockerfile built on a CUDA PyTorch base and pushed to your registry (or imported
# with `enroot import -o /shared/images/aura.sqsh dockerd://aura-hpc:latest`). For InfiniBand, build
# it on an NGC base (BASE_IMAGE=nvcr.io/nvidia/pytorch:<tag>): the default base has no libibverbs and
# NCCL would fall back to TCP between nodes (docs/containers.md).
#
# Lines read by aura_hpc:
#   #SBATCH --option=value   defaults for the job (the config's slurm section and CLI flags win)
#   #AURA key=value          aura_hpc settings: output_dir, max_gpus_per_node, gpu_mem_gib, screen_*, and the
#                            container: container (pyxis | apptainer), container_image,
#                            container_mounts (output_dir and data.path at their own paths),
#                            container_workdir, container_python
#   anything else            runs in the job script on the host, before srun starts the containers
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=14
# Consecutive ranks on one socket (ranks 0-3 beside GPUs 0-3, 4-7 beside 4-7, as a DGX wires them). Slurm's default
# second level is cyclic: ranks 0, 2, 4, 6 on socket 0, so half the ranks ran their host work and NCCL's proxy thread
# on the socket far from their GPU. Check yours with `nvidia-smi topo -m` (CPU Affinity) and change it if it differs.
#SBATCH --distribution=block:block
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --exclusive
#AURA max_gpus_per_node=8
#AURA gpu_mem_gib=79
# What pre-flight screening (--screen) expects of a healthy node: bf16 matmul TFLOP/s per GPU (~790 of the
# 989 dense peak of an H100/H200 SXM), all-reduce bus bandwidth in GB/s within a node (NVLink, 440-480 at
# 256 MiB) and across nodes (400G InfiniBand, ~370). Public figures, not measured by aura_hpc: replace them
# with `selftest --screen` results of your own healthy nodes. Below 0.8 of one names the node.
#AURA screen_gemm_tflops=790
#AURA screen_allreduce_gbps=440
#AURA screen_inter_gbps=370
#AURA output_dir=/shared/$USER/aura_runs
#AURA container=pyxis
#AURA container_image=registry.example.org#aura/aura-hpc:latest
#AURA container_mounts=/shared:/shared

# Exported here, inherited by the containers (Pyxis passes the job's environment in).
# --cpus-per-task=14: 8 tasks x 14 = the 112 cores of a DGX H100 (2 x 56) where Slurm counts cores as CPUs; where it
# counts hardware threads (`scontrol show node`: CPUTot=224), 14 CPUs are 7 cores, half the node: use 28 there.
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
# NCCL_SOCKET_IFNAME unset: NCCL takes IPoIB (ib*) first, else any interface but docker and lo (h100-ib.sh says why).
export NCCL_IB_HCA=mlx5
# Enroot's hook mounts the InfiniBand devices into the container only when this is set (sites with
# ENROOT_RESTRICT_DEV=y): without them NCCL finds no HCA and carries the data over TCP sockets.
export MELLANOX_VISIBLE_DEVICES=all
export NCCL_DEBUG=WARN
# 3, torch's default: a failed collective ends the process at once (1 and 2 abort the communicators first, which can hang).
export TORCH_NCCL_ASYNC_ERROR_HANDLING=3
export TORCH_NCCL_DUMP_ON_TIMEOUT=1
# Its size and dump files are aura_hpc's to set, per run (RUN_DIR/logs: each point of a sweep its own,
# under the names this job's torch reads), where the hang watchdog looks for them.
