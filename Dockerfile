# aura_hpc in a container: the same `python -m aura_hpc` commands, on LAN GPU machines (Docker +
# NVIDIA Container Toolkit) and on Slurm clusters (Pyxis/Enroot or Apptainer run this image).
#
#   docker compose build                      # BASE_IMAGE: a CUDA PyTorch image (torch >= 2.6, Python >= 3.11)
#   docker compose run --rm trainer check     # GPUs, NCCL, disk, network as the container sees them
#   docker compose run --rm trainer local     # train (see compose.yaml for the multi-node variables)
#
# BASE_IMAGE must already hold CUDA PyTorch >= 2.6 and Python >= 3.11 (its torch is used, not
# replaced). Without a registry (an air-gapped cluster, CI): docker/build-cpu-image.sh builds a
# Debian base and installs everything from local wheels through PIP_INSTALL_ARGS.
ARG BASE_IMAGE=pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime

# Stage 1: install into a venv that sees the base image's packages (its CUDA torch stays; pip adds
# the rest; Debian's "externally managed" Python is left alone). Local wheels stay in this stage.
# The base's torch is pinned for pip: one that does not satisfy torch>=2.6 stops the build with pip's
# conflict, instead of being replaced by PyPI's (gigabytes, another CUDA). NGC images 25.01/25.02 ship
# 2.6.0a0+..., a pre-release that >=2.6 does not admit: use a released torch's base or a newer NGC.
FROM ${BASE_IMAGE} AS build
# docker/build-cpu-image.sh names itself here, in both stages: it removes the untagged images of its own
# builds (a replaced image, a failed or stopped build's steps) and no other (empty in `docker compose build`).
ARG AURA_BUILT_BY=""
LABEL org.aura-hpc.built-by=${AURA_BUILT_BY}
ARG PIP_INSTALL_ARGS=""
COPY . /opt/aura_hpc/src
RUN python3 -m venv --system-site-packages /opt/aura_hpc/venv \
 && { /opt/aura_hpc/venv/bin/python -c "import torch; print('torch==' + torch.__version__)" 2>/dev/null || true; } > /tmp/base-torch.txt \
 && /opt/aura_hpc/venv/bin/python -m pip install --no-cache-dir -c /tmp/base-torch.txt ${PIP_INSTALL_ARGS} "/opt/aura_hpc/src[s3]"

# Stage 2: the same base, the venv, a non-root user.
FROM ${BASE_IMAGE}
ARG AURA_BUILT_BY=""
LABEL org.aura-hpc.built-by=${AURA_BUILT_BY}
ARG AURA_UID=1000
COPY --from=build /opt/aura_hpc/venv /opt/aura_hpc/venv
COPY docker/entrypoint.sh /opt/aura_hpc/entrypoint.sh
# --non-unique: NGC bases from 25.01 already have a user (ubuntu) with uid 1000.
RUN (id -u aura >/dev/null 2>&1 || useradd --non-unique --create-home --uid ${AURA_UID} --shell /bin/bash aura) \
 && mkdir -p /work && chown aura /work

# No cache folder fixed in /tmp here: Apptainer binds the host's /tmp and keeps an image's ENV, so
# every user of a node would share one (the first user's, unwritable or planted for the next). The
# defaults are per user (~/.cache/huggingface, /tmp/torchinductor_$USER); compose.yaml sets its own.
# PYTHONNOUSERSITE: Apptainer binds $HOME, and a `pip install --user torch` there once came before the image's
# torch (the venv sees system site-packages, and so the user's too): another CUDA, another NCCL.
ENV PATH=/opt/aura_hpc/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONNOUSERSITE=1 \
    AURA_LOCAL_FROM_ENV=1

USER aura
WORKDIR /work
# aura_hpc's commands go to `python -m aura_hpc`; other programs (nvidia-smi, bash) run as given.
ENTRYPOINT ["/opt/aura_hpc/entrypoint.sh"]
CMD ["--help"]
