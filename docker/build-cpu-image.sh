#!/bin/bash
# Build the aura_hpc image without any image registry or index in the build: a Debian base made
# with debootstrap, and every Python package from wheels downloaded here first (the pip index
# this machine is configured with). Used by CI; also the way to build on an air-gapped machine.
#
#   docker/build-cpu-image.sh [TAG]        (default aura-hpc:cpu; needs root, docker, debootstrap)
#   docker/build-cpu-image.sh --base-only  (the Debian base alone: it needs no Python, so CI starts it
#                                           before its venv exists; the next call then skips it)
#
# The GPU image is built from a CUDA PyTorch base instead: `docker compose build` (see Dockerfile).
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_ONLY=0
if [ "${1:-}" = "--base-only" ]; then BASE_ONLY=1; shift; fi
TAG=${1:-aura-hpc:cpu}
BASE=${AURA_CPU_BASE:-aura-base:bookworm}
TORCH=${AURA_TORCH:-torch==2.13.0}

if ! docker image inspect "$BASE" >/dev/null 2>&1; then
  t0=$(date +%s)
  root=$(mktemp -d /tmp/aura-rootfs.XXXXXX)
  # AURA_DEBIAN_MIRROR: another Debian mirror (default: debootstrap's, deb.debian.org).
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" ${AURA_DEBIAN_MIRROR:-} >/dev/null
  tar -C "$root" -c . | docker import - "$BASE" >/dev/null
  rm -rf "$root"
  echo "base image $BASE: $(( $(date +%s) - t0 ))s"
fi
if [ "$BASE_ONLY" = 1 ]; then exit 0; fi

t0=$(date +%s)
wheels=docker/wheels
mkdir -p "$wheels"
# torch (the CPU build this machine's index serves), the package's dependencies (with s3fs), and the build backend.
python3 -m pip download -q -d "$wheels" "$TORCH" ".[s3]" "setuptools>=77" wheel 2>&1 | grep -v "is ignored" || true
# An sdist (deepspeed) would need torch to build inside the image: build its wheel here.
for sdist in "$wheels"/*.tar.gz; do
  [ -e "$sdist" ] || continue
  python3 -m pip wheel -q --no-deps --no-build-isolation -w "$wheels" "$sdist"
  rm -f "$sdist"
done
echo "wheels: $(ls "$wheels" | wc -l) files, $(du -sh "$wheels" | cut -f1), $(( $(date +%s) - t0 ))s"

# Every build left the previous image and its install stage behind as untagged images, about 4 GB a
# build; on a machine that keeps its disk (CI's here does) 55 GB of them filled it. Now every image of
# this script's builds carries its label (the Dockerfile's AURA_BUILT_BY), and at every exit (a failed or
# stopped build's included) the untagged images with the label that no container holds are removed: the
# install stage, the image this tag named before, a stopped build's steps. A tag a user gave one
# (`docker tag`) keeps it, and docker keeps one a container uses. An untagged image built FROM this one
# inherits the label: it goes too. Images of `docker compose build` have the label empty: never touched.
BUILT_BY=docker/build-cpu-image.sh
trap 'docker image prune -f --filter "label=org.aura-hpc.built-by=$BUILT_BY" >/dev/null 2>&1 || true' EXIT
t0=$(date +%s)
log=$(mktemp /tmp/aura-docker-build.XXXXXX)
docker build --network host --force-rm -t "$TAG" \
  --build-arg BASE_IMAGE="$BASE" --build-arg AURA_BUILT_BY="$BUILT_BY" \
  --build-arg PIP_INSTALL_ARGS="--no-index --find-links /opt/aura_hpc/src/docker/wheels" . >"$log" 2>&1 \
  || { tail -40 "$log"; echo "docker build failed (whole log: $log)" >&2; exit 1; }
rm -f "$log"  # kept only when the build failed
echo "image $TAG: $(( $(date +%s) - t0 ))s, $(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.2f GB", $1/1e9}')"
