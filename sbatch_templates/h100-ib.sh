#!/bin/bash
# aura_hpc cluster profile "h100-ib": nodes with 8x NVIDIA H100 SXM and an InfiniBand fabric
# (one ConnectX HCA per GPU, GPUDirect RDMA). Copy and edit for your site; pass the copy with
# --cluster /path/to/profile.sh.
#
# Lines read by aura_hpc:
#   #SBATCH --option=value   defaults for the job (the config's slurm section and CLI flags win)
#   #AURA key=value          aura_hpc settings: output_dir (shared by all nodes), max_gpus_per_node,
#                            gpu_mem_gib (the memory plan refuses a job that cannot fit),
#                            screen_gemm_tflops, screen_allreduce_gbps, screen_inter_gbps (--screen)
#   anything else            runs in the job script before the trainer (modules, venv, exports)
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

# Site software: change the module names to what `module avail` shows on your cluster.
# A missing module is said in the job's log (the job goes on: the venv may bring its own CUDA).
if command -v module >/dev/null 2>&1; then
  module purge
  module load cuda/12.4 || echo "aura_hpc: module cuda/12.4 is not available on $(hostname) (fix: change the module line of the cluster profile)" >&2
else
  echo "aura_hpc: no 'module' command on $(hostname); the profile's module lines were skipped" >&2
fi
# The Python environment aura_hpc is installed in (same path on every node).
if [ -f "${AURA_VENV:-$HOME/venvs/aura}/bin/activate" ]; then source "${AURA_VENV:-$HOME/venvs/aura}/bin/activate"; fi

# Threads per rank for CPU-side work (data loading, optimizer on CPU): the task's CPUs. --cpus-per-task=14:
# 8 tasks x 14 = the 112 cores of a DGX H100/H200 (2 x 56) where Slurm counts cores as CPUs. Where it counts
# hardware threads (`scontrol show node` says CPUTot=224), 14 CPUs are 7 cores, half the node: use 28 there.
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
# NCCL_SOCKET_IFNAME (the bootstrap's TCP interface; the data goes over InfiniBand) is left unset: NCCL then takes
# IPoIB (ib*) first, else any interface but docker and lo. A value replaces that choice: ^lo,docker dropped the IPoIB
# preference and could take a management NIC or virbr0 (192.168.122.1 on every node). Set it (=ib0, =bond0) when
# `python -m aura_hpc check` between two nodes names another interface than the one they share.
# The HCAs NCCL may use for the data: "mlx5" matches every ConnectX port. List the compute-fabric
# ports explicitly (e.g. =mlx5_0,mlx5_3,...) when some HCAs serve storage instead.
export NCCL_IB_HCA=mlx5
# RoCE only (Ethernet with RDMA, not InfiniBand): the GID index for RoCE v2, usually 3.
# export NCCL_IB_GID_INDEX=3
# NCCL_NET_GDR_LEVEL is left unset on purpose: NCCL picks GPUDirect RDMA from the PCIe topology.
# Set it (e.g. PHB) only when nvidia-smi topo -m shows GPU and HCA behind different switches.
# NCCL prints warnings only; `submit --nccl-debug` switches to INFO with a file per host.
export NCCL_DEBUG=WARN
# A failed or hung collective tears the job down (and Slurm can requeue) instead of hanging: 3, torch's
# default, ends the process at once; 1 and 2 first abort NCCL's communicators, which can hang themselves.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=3
# On a collective timeout, dump the flight recorder (last collectives per rank) for debugging.
export TORCH_NCCL_DUMP_ON_TIMEOUT=1
# Its size and dump files are aura_hpc's to set, per run (RUN_DIR/logs: each point of a sweep its own,
# under the names this job's torch reads), where the hang watchdog looks for them.
