#!/usr/bin/env bash
# Export a directory over NFS to the machines that train together (run on the storage/master node).
#
#   sudo nfs_setup/server.sh --export /srv/aura --clients 192.168.1.0/24 [--clients 10.0.0.5 ...] \
#        [--owner 1000:1000] [--dry-run]
#
# Idempotent: running it again changes nothing. --dry-run prints what would change and changes nothing.
# Options on the export: rw,sync,no_subtree_check (sync: a checkpoint is on disk when the write
# returns; no_subtree_check: fewer stale handles on renames, which atomic checkpoints do a lot).
set -euo pipefail

EXPORTS=${AURA_NFS_EXPORTS:-/etc/exports}   # test hook: another exports file
NO_SYSTEM=${AURA_NFS_NO_SYSTEM:-0}           # test hook: no apt, no exportfs, no firewall
DRY=0
EXPORT_DIR=""
OWNER=""
CLIENTS=()
OPTIONS="rw,sync,no_subtree_check"

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --export) EXPORT_DIR=$2; shift 2 ;;
    --clients) CLIENTS+=("$2"); shift 2 ;;
    --owner) OWNER=$2; shift 2 ;;
    --options) OPTIONS=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage ;;
    *) echo "error: unknown option $1 (fix: see --help)" >&2; exit 2 ;;
  esac
done
[[ -n $EXPORT_DIR && ${#CLIENTS[@]} -gt 0 ]] || { echo "error: --export DIR and at least one --clients SUBNET|HOST are needed (fix: e.g. --export /srv/aura --clients 192.168.1.0/24)" >&2; exit 2; }
[[ $EXPORT_DIR == /* ]] || { echo "error: --export must be an absolute path, got $EXPORT_DIR (fix: e.g. /srv/aura)" >&2; exit 2; }

changes=0
do_() { # describe, then run unless --dry-run
  local what=$1; shift
  changes=$((changes + 1))
  if [[ $DRY == 1 ]]; then echo "would: $what"; else echo "doing: $what"; "$@"; fi
}

# 1. the NFS server package
if [[ $NO_SYSTEM != 1 ]]; then
  if ! command -v exportfs >/dev/null 2>&1; then
    if command -v apt-get >/dev/null; then do_ "install nfs-kernel-server" apt-get install -y nfs-kernel-server
    elif command -v dnf >/dev/null; then do_ "install nfs-utils" dnf install -y nfs-utils
    else echo "error: no apt-get or dnf here (fix: install your distribution's NFS server package)" >&2; exit 1; fi
  fi
fi

# 2. the directory
if [[ ! -d $EXPORT_DIR ]]; then do_ "create $EXPORT_DIR" mkdir -p "$EXPORT_DIR"; fi
if [[ -n $OWNER && ( ! -d $EXPORT_DIR || $(stat -c %u:%g "$EXPORT_DIR") != "$OWNER" ) ]]; then
  do_ "chown $OWNER $EXPORT_DIR (the same UID:GID as the training user on every client)" chown "$OWNER" "$EXPORT_DIR"
fi

# 3. /etc/exports: one line per directory, owned by this script
clients_field=""
for c in "${CLIENTS[@]}"; do clients_field+=" $c($OPTIONS)"; done
line="$EXPORT_DIR${clients_field}"
current=$(awk -v d="$EXPORT_DIR" '$1 == d' "$EXPORTS" 2>/dev/null || true)
if [[ $current == "$line" ]]; then
  echo "ok: $EXPORTS already exports $EXPORT_DIR as wanted"
else
  replace() {
    touch "$EXPORTS"
    cp "$EXPORTS" "$EXPORTS.aura-backup"
    { awk -v d="$EXPORT_DIR" '$1 != d' "$EXPORTS.aura-backup"; echo "$line"; } >"$EXPORTS.tmp"
    mv "$EXPORTS.tmp" "$EXPORTS"
  }
  if [[ -n $current ]]; then do_ "replace in $EXPORTS: '$current' -> '$line'" replace
  else do_ "add to $EXPORTS: '$line'" replace; fi
  if [[ $NO_SYSTEM != 1 ]]; then do_ "reload the exports (exportfs -ra)" exportfs -ra; fi
fi

# 4. firewall: NFSv4 needs only TCP 2049 from the clients
if [[ $NO_SYSTEM != 1 ]] && command -v ufw >/dev/null && ufw status 2>/dev/null | grep -q "Status: active"; then
  for c in "${CLIENTS[@]}"; do
    if ! ufw status | grep -q "2049.*ALLOW.*$c"; then do_ "open TCP 2049 (NFSv4) to $c in ufw" ufw allow from "$c" to any port 2049 proto tcp; fi
  done
fi

if [[ $changes == 0 ]]; then echo "nothing to change"; elif [[ $DRY == 1 ]]; then echo "dry run: $changes change(s) not made"; fi
