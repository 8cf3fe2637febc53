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

# Every build leaves the previous image and its install stage behind as untagged images, about 4 GB a
# build; on a machine that keeps its disk (CI's here does) 55 GB of them filled it. The install stage is
# tagged while it is built and removed after (its untagged parents go with it), and the image this tag
# named before is removed once replaced, if this script built it (its label says so): nothing else.
LABEL=org.aura-hpc.built-by=docker/build-cpu-image.sh
STAGE=aura-hpc-install-stage:$$
previous=$(docker image inspect -f "{{.Id}} {{index .Config.Labels \"${LABEL%%=*}\"}}" "$TAG" 2>/dev/null || true)
# A failed or stopped build leaves the install stage's steps so far as untagged images: they carry the
# stage's label (Dockerfile), and only those that no tag names are removed, at every exit. One the daemon
# still held (a stopped build's last step, as the script was stopped) goes at the next build's exit.
trap 'docker rmi "$STAGE" >/dev/null 2>&1; docker image prune -f --filter label=org.aura-hpc.stage=install >/dev/null 2>&1 || true' EXIT
t0=$(date +%s)
log=$(mktemp /tmp/aura-docker-build.XXXXXX)
build() {
  docker build --network host --force-rm "$@" \
    --build-arg BASE_IMAGE="$BASE" \
    --build-arg PIP_INSTALL_ARGS="--no-index --find-links /opt/aura_hpc/src/docker/wheels" . >>"$log" 2>&1 \
    || { tail -40 "$log"; echo "docker build failed (whole log: $log)" >&2; exit 1; }
}
build --target build -t "$STAGE"
build --label "$LABEL" -t "$TAG"
rm -f "$log"  # kept only when the build failed
echo "image $TAG: $(( $(date +%s) - t0 ))s, $(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.2f GB", $1/1e9}')"
# Only once no tag names it any more: one a user gave it (`docker tag`) keeps it.
if [ -n "$previous" ] && [ "${previous#* }" = "${LABEL#*=}" ] \
  && [ "$(docker image inspect -f '{{len .RepoTags}}' "${previous%% *}" 2>/dev/null)" = 0 ]; then
  # docker refuses while a container (even a stopped one) uses it: then it stays, and is said.
  docker rmi "${previous%% *}" >/dev/null 2>&1 || echo "the previous $TAG (${previous%% *}) is kept: a container uses it"
fi
