#!/usr/bin/env bash
# Mount the NFS export on a machine that trains (every node, the master too if it is not the server).
#
#   sudo nfs_setup/client.sh --server 192.168.1.10 --export /srv/aura --mount /shared/aura [--dry-run]
#
# Installs the NFS client, mounts, verifies that a file written here can be read back, and
# persists the mount in /etc/fstab. Idempotent; --dry-run prints what would change.
set -euo pipefail

FSTAB=${AURA_NFS_FSTAB:-/etc/fstab}        # test hook: another fstab
NO_SYSTEM=${AURA_NFS_NO_SYSTEM:-0}         # test hook: no apt, no mount, no write check
DRY=0
SERVER=""
EXPORT_DIR=""
MOUNT=""
# hard: a server hiccup pauses I/O instead of corrupting a checkpoint; _netdev: mount after the network.
OPTIONS="rw,hard,noatime,_netdev"

usage() { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --server) SERVER=$2; shift 2 ;;
    --export) EXPORT_DIR=$2; shift 2 ;;
    --mount) MOUNT=$2; shift 2 ;;
    --options) OPTIONS=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage ;;
    *) echo "error: unknown option $1 (fix: see --help)" >&2; exit 2 ;;
  esac
done
[[ -n $SERVER && -n $EXPORT_DIR && -n $MOUNT ]] || { echo "error: --server, --export and --mount are needed (fix: e.g. --server 192.168.1.10 --export /srv/aura --mount /shared/aura)" >&2; exit 2; }
[[ $MOUNT == /* ]] || { echo "error: --mount must be an absolute path, got $MOUNT" >&2; exit 2; }

changes=0
do_() {
  local what=$1; shift
  changes=$((changes + 1))
  if [[ $DRY == 1 ]]; then echo "would: $what"; else echo "doing: $what"; "$@"; fi
}

if [[ $NO_SYSTEM != 1 ]] && ! command -v mount.nfs >/dev/null 2>&1 && ! [[ -x /sbin/mount.nfs ]]; then
  if command -v apt-get >/dev/null; then do_ "install nfs-common" apt-get install -y nfs-common
  elif command -v dnf >/dev/null; then do_ "install nfs-utils" dnf install -y nfs-utils
  else echo "error: no apt-get or dnf here (fix: install your distribution's NFS client package)" >&2; exit 1; fi
fi

if [[ ! -d $MOUNT ]]; then do_ "create mount point $MOUNT" mkdir -p "$MOUNT"; fi

line="$SERVER:$EXPORT_DIR $MOUNT nfs4 $OPTIONS 0 0"
current=$(awk -v m="$MOUNT" '$2 == m' "$FSTAB" 2>/dev/null || true)
if [[ $current == "$line" ]]; then
  echo "ok: $FSTAB already mounts $MOUNT as wanted"
else
  persist() {
    touch "$FSTAB"
    cp "$FSTAB" "$FSTAB.aura-backup"
    { awk -v m="$MOUNT" '$2 != m' "$FSTAB.aura-backup"; echo "$line"; } >"$FSTAB.tmp"
    mv "$FSTAB.tmp" "$FSTAB"
  }
  if [[ -n $current ]]; then do_ "replace in $FSTAB: '$current' -> '$line'" persist
  else do_ "add to $FSTAB: '$line'" persist; fi
fi

if [[ $NO_SYSTEM != 1 ]]; then
  if ! mountpoint -q "$MOUNT"; then do_ "mount $SERVER:$EXPORT_DIR at $MOUNT" mount "$MOUNT"; fi
  if [[ $DRY != 1 ]]; then
    probe="$MOUNT/.aura-nfs-check-$(hostname)-$$"
    if ! echo ok >"$probe" 2>/dev/null; then
      echo "error: cannot write in $MOUNT (fix: on the server, chown the export to this user's UID:GID $(id -u):$(id -g), or pass --owner to server.sh)" >&2
      exit 1
    fi
    [[ $(cat "$probe") == ok ]] || { echo "error: read back a different content from $probe" >&2; exit 1; }
    echo "ok: wrote and read back $probe as uid $(stat -c %u "$probe") gid $(stat -c %g "$probe")"
    rm -f "$probe"
    echo "next: on every node, python -m aura_hpc check --nnodes N ... --shared-dir $MOUNT"
  fi
fi

if [[ $changes == 0 ]]; then echo "nothing to change"; elif [[ $DRY == 1 ]]; then echo "dry run: $changes change(s) not made"; fi
