#!/usr/bin/env bash
# Mount the NFS export on a machine that trains (every node, the master too if it is not the server).
#
#   sudo nfs_setup/client.sh --server 192.168.1.10 --export /shared/aura --mount /shared/aura [--dry-run]
#
# Installs the NFS client, mounts, verifies that a file written here by the user who ran sudo can be
# read back, and persists the mount in /etc/fstab under a marker comment (a line of the admin's for
# the same mount point is never replaced). Idempotent; --dry-run prints what would change.
set -euo pipefail

FSTAB=${AURA_NFS_FSTAB:-/etc/fstab}        # test hook: another fstab
NO_SYSTEM=${AURA_NFS_NO_SYSTEM:-0}         # test hook: no apt, no mount, no write check
DRY=0
SERVER=""
EXPORT_DIR=""
MOUNT=""
# hard: a server hiccup pauses I/O instead of corrupting a checkpoint; _netdev: mount after the network;
# nofail and x-systemd.automount: a laptop that boots while the server is off or away boots at once, and
# mounts on first use (with `hard` alone it waited for systemd's mount timeout at every such boot).
OPTIONS="rw,hard,noatime,_netdev,nofail,x-systemd.automount,x-systemd.mount-timeout=15"
MARK="# aura_hpc nfs_setup: the next line is this script's (run it again to change it)"

usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
need() { [[ $# -ge 2 && -n $2 ]] || { echo "error: $1 needs a value (fix: see --help)" >&2; exit 2; }; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --server) need "$@"; SERVER=$2; shift 2 ;;
    --export) need "$@"; EXPORT_DIR=$2; shift 2 ;;
    --mount) need "$@"; MOUNT=$2; shift 2 ;;
    --options) need "$@"; OPTIONS=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage 0 ;;
    *) echo "error: unknown option $1 (fix: see --help)" >&2; exit 2 ;;
  esac
done
[[ -n $SERVER && -n $EXPORT_DIR && -n $MOUNT ]] || { echo "error: --server, --export and --mount are needed (fix: e.g. --server 192.168.1.10 --export /srv/aura --mount /shared/aura)" >&2; exit 2; }
[[ $MOUNT == /* ]] || { echo "error: --mount must be an absolute path, got $MOUNT (fix: e.g. /shared/aura)" >&2; exit 2; }
while [[ $MOUNT == */ && $MOUNT != / ]]; do MOUNT=${MOUNT%/}; done  # /x/ and /x are one mount point
while [[ $EXPORT_DIR == */ && $EXPORT_DIR != / ]]; do EXPORT_DIR=${EXPORT_DIR%/}; done
# fstab splits at blanks: a line for "/shared/my aura" had seven fields, and every run added another.
[[ $MOUNT$EXPORT_DIR != *[[:space:]]* ]] || { echo "error: --mount and --export must be paths without blanks (fix: e.g. /shared/aura)" >&2; exit 2; }
if [[ $(uname -s) == Darwin ]]; then  # no fstab, apt or runuser: macOS mounts NFS itself, from a reserved port
  echo "error: this script sets up Linux clients (fix: on macOS, sudo mkdir -p $MOUNT && sudo mount -t nfs -o resvport,rw,hard $SERVER:$EXPORT_DIR $MOUNT)" >&2; exit 1
fi
if [[ $NO_SYSTEM != 1 && $DRY != 1 && $EUID != 0 ]]; then
  echo "error: installing, mounting and editing $FSTAB need root (fix: sudo $0 ...)" >&2; exit 2
fi

changes=0
do_() {
  local what=$1; shift
  changes=$((changes + 1))
  if [[ $DRY == 1 ]]; then echo "would: $what"; else echo "doing: $what"; "$@"; fi
}

if [[ $NO_SYSTEM != 1 ]] && ! command -v mount.nfs >/dev/null 2>&1 && ! [[ -x /sbin/mount.nfs ]]; then
  if command -v apt-get >/dev/null; then do_ "install nfs-common" sh -c 'apt-get update -q && apt-get install -y nfs-common'
  elif command -v dnf >/dev/null; then do_ "install nfs-utils" dnf install -y nfs-utils
  else echo "error: no apt-get or dnf here (fix: install your distribution's NFS client package)" >&2; exit 1; fi
fi

if [[ ! -d $MOUNT ]]; then do_ "create mount point $MOUNT" mkdir -p "$MOUNT"; fi

line="$SERVER:$EXPORT_DIR $MOUNT nfs4 $OPTIONS 0 0"
# Each line for the mount point, "ours" (under the marker) or "theirs" (the admin's, or an older version's).
# An admin's `/mnt/aura/` names the same mount point.
entries=$(awk -v k="$MOUNT" -v mark="$MARK" '$0 == mark { m = 1; next } { d = $2; sub(/\/+$/, "", d) } d == k && d != "" { print (m ? "ours" : "theirs") "\t" $0 } { m = 0 }' "$FSTAB" 2>/dev/null || true)
theirs=$(printf '%s\n' "$entries" | awk -F'\t' '$1 == "theirs" { print $2 }')
current=$(printf '%s\n' "$entries" | awk -F'\t' '$1 == "ours" { print $2 }')
if [[ -n $theirs && $theirs != "$line" ]]; then
  echo "error: $FSTAB already mounts something at $MOUNT in a line this script did not write: '$(head -n1 <<<"$theirs")' (fix: choose another --mount, or remove that line and run this again)" >&2
  exit 1
elif [[ -n $theirs || $current == "$line" ]]; then
  echo "ok: $FSTAB already mounts $MOUNT as wanted"
else
  # Renamed over it, the file took the new one's mode (umask 077: 0600), a link became a file, and SELinux's label
  # went: written beside its real path instead, with its mode and owner, then renamed, then its label restored.
  # Each step stops the script on its own: `set -e` does not see a failure before the last `&&` (a cp cut short by a full
  # disk went on, and the cut copy was renamed over the file).
  write_over() {
    local target new
    target=$(readlink -f "$2") || { echo "error: cannot resolve $2" >&2; exit 1; }
    new="$target.aura-new"
    if ! cp "$1" "$new" || ! chmod "$(stat -c %a "$target")" "$new"; then
      rm -f "$new"
      echo "error: could not write $new (a full disk?); $2 is unchanged (fix: free space, then run this again)" >&2
      exit 1
    fi
    chown "$(stat -c %u:%g "$target")" "$new" 2>/dev/null || true
    mv "$new" "$target" || { rm -f "$new"; echo "error: could not replace $target; it is unchanged" >&2; exit 1; }
    rm -f "$1"
    if command -v restorecon >/dev/null; then restorecon "$target" 2>/dev/null || true; fi
  }
  persist() {
    touch "$FSTAB"
    cp "$FSTAB" "$FSTAB.aura-backup"
    { awk -v k="$MOUNT" -v mark="$MARK" '
        $0 == mark { held = $0; next }
        held != "" { if ($2 == k) { held = ""; next } print held; held = "" }
        { print }
        END { if (held != "") print held }' "$FSTAB.aura-backup"
      echo "$MARK"; echo "$line"; } >"$FSTAB.tmp"
    write_over "$FSTAB.tmp" "$FSTAB"
  }
  if [[ -n $current ]]; then do_ "replace in $FSTAB: '$current' -> '$line'" persist
  else do_ "add to $FSTAB: '$line'" persist; fi
fi

if [[ $NO_SYSTEM != 1 ]]; then
  if mountpoint -q "$MOUNT"; then
    # x-systemd.automount: after a reboot systemd's autofs sits there (source systemd-1) until the first use.
    ls "$MOUNT" >/dev/null 2>&1 || true
    source=$(findmnt -n -o SOURCE,FSTYPE --mountpoint "$MOUNT" 2>/dev/null | awk '$2 != "autofs" { s = $1 } END { print s }' || true)
    if [[ $source != "$SERVER:$EXPORT_DIR" ]]; then  # another filesystem there: the nodes would not share one
      echo "error: $MOUNT already has $source mounted, not $SERVER:$EXPORT_DIR (fix: unmount it, or choose another --mount)" >&2
      exit 1
    fi
  else
    do_ "mount $SERVER:$EXPORT_DIR at $MOUNT" mount "$MOUNT"
  fi
  if [[ $DRY != 1 ]]; then
    # As the user who ran sudo, who trains: root is `nobody` on the server under root_squash.
    user=${SUDO_USER:-}
    if [[ -z $user || $user == root ]]; then
      echo "note: skipped the write check: run this with sudo from the training user's account to have it write as that user"
    else
      probe="$MOUNT/.aura-nfs-check-$(hostname)-$$"
      if ! runuser -u "$user" -- sh -c 'echo ok >"$1"' _ "$probe" 2>/dev/null; then
        echo "error: $user cannot write in $MOUNT (fix: on the server, chown the export to $user's UID:GID $(id -u "$user"):$(id -g "$user"), or pass --owner $(id -u "$user"):$(id -g "$user") to server.sh)" >&2
        exit 1
      fi
      # Read back as the user too: root is `nobody` on the server, and a umask 077 file is not nobody's to read.
      if [[ $(runuser -u "$user" -- cat "$probe" 2>/dev/null) != ok ]]; then
        runuser -u "$user" -- rm -f "$probe"
        echo "error: $user read back a different content from $probe (fix: check that $MOUNT is the server's $EXPORT_DIR, and no cache option such as nocto)" >&2
        exit 1
      fi
      echo "ok: $user wrote and read back $probe (uid $(stat -c %u "$probe") gid $(stat -c %g "$probe"))"
      runuser -u "$user" -- rm -f "$probe"
    fi
    echo "next: on every node, python -m aura_hpc check --nnodes N ... --shared-dir $MOUNT; then train with --output-dir $MOUNT/runs on every node"
  fi
fi

if [[ $changes == 0 ]]; then echo "nothing to change"; elif [[ $DRY == 1 ]]; then echo "dry run: $changes change(s) not made"; fi
