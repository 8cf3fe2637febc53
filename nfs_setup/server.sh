#!/usr/bin/env bash
# Export a directory over NFS to the machines that train together (run on the storage/master node).
#
#   sudo nfs_setup/server.sh --export /shared/aura --clients 192.168.1.0/24 [--clients 10.0.0.5 ...] \
#        [--owner 1000:1000] [--dry-run] [--allow-wide]
#
# Idempotent: running it again changes nothing. --dry-run prints what would change and changes nothing.
# Its line in /etc/exports sits under a marker comment; a line of the admin's for the same directory is
# never replaced (the script stops and says so). --allow-wide: export to * or with no_root_squash/insecure.
# Options on the export: rw,sync,no_subtree_check (sync: a checkpoint is on disk when the write
# returns; no_subtree_check: fewer stale handles on renames, which atomic checkpoints do a lot).
set -euo pipefail

EXPORTS=${AURA_NFS_EXPORTS:-/etc/exports}   # test hook: another exports file
NO_SYSTEM=${AURA_NFS_NO_SYSTEM:-0}           # test hook: no apt, no exportfs, no firewall
DRY=0
EXPORT_DIR=""
OWNER=""
CLIENTS=()
NAMED=()
OPTIONS="rw,sync,no_subtree_check"
ALLOW_WIDE=0
MARK="# aura_hpc nfs_setup: the next line is this script's (run it again to change it)"

usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
need() { [[ $# -ge 2 && -n $2 ]] || { echo "error: $1 needs a value (fix: see --help)" >&2; exit 2; }; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --export) need "$@"; EXPORT_DIR=$2; shift 2 ;;
    --clients) need "$@"; CLIENTS+=("$2"); shift 2 ;;
    --owner) need "$@"; OWNER=$2; shift 2 ;;
    --options) need "$@"; OPTIONS=$2; shift 2 ;;
    --allow-wide) ALLOW_WIDE=1; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage 0 ;;
    *) echo "error: unknown option $1 (fix: see --help)" >&2; exit 2 ;;
  esac
done
[[ -n $EXPORT_DIR && ${#CLIENTS[@]} -gt 0 ]] || { echo "error: --export DIR and at least one --clients SUBNET|HOST are needed (fix: e.g. --export /srv/aura --clients 192.168.1.0/24)" >&2; exit 2; }
[[ $EXPORT_DIR == /* ]] || { echo "error: --export must be an absolute path, got $EXPORT_DIR (fix: e.g. /shared/aura)" >&2; exit 2; }
while [[ $EXPORT_DIR == */ && $EXPORT_DIR != / ]]; do EXPORT_DIR=${EXPORT_DIR%/}; done  # /x/ and /x are one export
# /etc/exports splits at blanks: "/srv/my share" exported /srv/my to a host named share.
[[ $EXPORT_DIR != *[[:space:]]* ]] || { echo "error: --export $EXPORT_DIR holds a blank, which /etc/exports cannot hold as written (fix: a path without spaces, e.g. /srv/aura)" >&2; exit 2; }
if [[ -n $OWNER ]]; then  # numbers, as `stat` prints them: a name never matched, and every run chowned again
  o_user=${OWNER%%:*}; o_group=${OWNER#*:}; [[ $OWNER == *:* ]] || o_group=""
  [[ $o_user =~ ^[0-9]+$ ]] || o_user=$(id -u "$o_user" 2>/dev/null) || { echo "error: --owner $OWNER: no user ${OWNER%%:*} here (fix: --owner UID:GID, the training user's numbers on the clients)" >&2; exit 2; }
  if [[ -z $o_group ]]; then o_group=$(id -g "$o_user" 2>/dev/null) || { echo "error: --owner $OWNER: give the group too (fix: --owner UID:GID)" >&2; exit 2; }
  elif ! [[ $o_group =~ ^[0-9]+$ ]]; then o_group=$(getent group "$o_group" | cut -d: -f3); [[ -n $o_group ]] || { echo "error: --owner $OWNER: no group ${OWNER#*:} here (fix: --owner UID:GID)" >&2; exit 2; }; fi
  OWNER="$o_user:$o_group"
fi
# Each client goes into the exports line as written: a blank made "192.168.1.10 192.168.1.11" two clients, the
# first with exportfs's defaults (read-only), and "(...)" smuggled options past the checks below.
for c in "${CLIENTS[@]}"; do
  [[ $c =~ ^@?[A-Za-z0-9._:/*?-]+$ ]] || { echo "error: --clients '$c' is not one subnet, address or host name (fix: one --clients per client, e.g. --clients 192.168.1.10 --clients 192.168.1.11)" >&2; exit 2; }
done
[[ $OPTIONS =~ ^[A-Za-z0-9_=,:.-]+$ ]] || { echo "error: --options '$OPTIONS' is not a comma-separated list of export options (fix: e.g. --options rw,sync,no_subtree_check)" >&2; exit 2; }
if [[ $ALLOW_WIDE != 1 ]]; then
  for c in "${CLIENTS[@]}"; do
    prefix=128
    if [[ $c =~ /([0-9]+)$ ]]; then prefix=$((10#${BASH_REMATCH[1]})); fi
    # A prefix shorter than /8 (IPv4) or /16 (IPv6) is most of the internet: 0.0.0.0/1 and 128.0.0.0/1 were "narrow".
    if [[ $c == *"*"* || ( $c != *:* && $prefix -lt 8 ) || ( $c == *:* && $prefix -lt 16 ) ]]; then
      echo "error: --clients $c exports $EXPORT_DIR to every machine that reaches this one (fix: the training machines' subnet, e.g. 192.168.1.0/24, or --allow-wide)" >&2; exit 2
    fi
  done
  if [[ ,$OPTIONS, == *,no_root_squash,* ]]; then
    echo "error: --options $OPTIONS lets root on a client act as root here (fix: drop no_root_squash, or --allow-wide)" >&2; exit 2
  fi
  if [[ ,$OPTIONS, == *,insecure,* ]]; then  # what a macOS client without resvport needs
    echo "error: --options $OPTIONS accepts mounts from any user's unprivileged port on a client (fix: on macOS clients mount with -o resvport instead, or --allow-wide)" >&2; exit 2
  fi
fi

changes=0
do_() { # describe, then run unless --dry-run
  local what=$1; shift
  changes=$((changes + 1))
  if [[ $DRY == 1 ]]; then echo "would: $what"; else echo "doing: $what"; "$@"; fi
}

# 1. the NFS server package
if [[ $NO_SYSTEM != 1 ]]; then
  if ! command -v exportfs >/dev/null 2>&1; then
    # The package lists first: a fresh cloud or container image has none, and the install fails without them.
    if command -v apt-get >/dev/null; then do_ "install nfs-kernel-server" sh -c 'apt-get update -q && apt-get install -y nfs-kernel-server'
    elif command -v dnf >/dev/null; then do_ "install nfs-utils" dnf install -y nfs-utils
    else echo "error: no apt-get or dnf here (fix: install your distribution's NFS server package)" >&2; exit 1; fi
  fi
fi

# 2. the directory
if [[ ! -d $EXPORT_DIR ]]; then do_ "create $EXPORT_DIR" mkdir -p "$EXPORT_DIR"; fi
if [[ -n $OWNER && ( ! -d $EXPORT_DIR || $(stat -c %u:%g "$EXPORT_DIR") != "$OWNER" ) ]]; then
  do_ "chown $OWNER $EXPORT_DIR (the same UID:GID as the training user on every client)" chown "$OWNER" "$EXPORT_DIR"
fi

# 3. /etc/exports: one line per directory, under this script's marker
clients_field=""
for c in "${CLIENTS[@]}"; do
  clients_field+=" $c($OPTIONS)"
  # NFS takes a client's word for its user numbers: any machine of the subnet with a root login can be the training user.
  if [[ $c == */* ]]; then
    echo "note: every machine in $c can mount $EXPORT_DIR as any user it claims to be: on a network with guests, name the training machines instead (--clients ADDRESS once per machine)"
  fi
done
line="$EXPORT_DIR${clients_field}"
# Each line for the directory, "ours" (under the marker) or "theirs" (the admin's, or an older version's).
# An admin's `/srv/aura/` names the same directory.
entries=$(awk -v k="$EXPORT_DIR" -v mark="$MARK" '$0 == mark { m = 1; next } { d = $1; sub(/\/+$/, "", d) } d == k && d != "" { print (m ? "ours" : "theirs") "\t" $0 } { m = 0 }' "$EXPORTS" 2>/dev/null || true)
theirs=$(printf '%s\n' "$entries" | awk -F'\t' '$1 == "theirs" { print $2 }')
current=$(printf '%s\n' "$entries" | awk -F'\t' '$1 == "ours" { print $2 }')
if [[ -n $theirs && $theirs != "$line" ]]; then
  echo "error: $EXPORTS already exports $EXPORT_DIR in a line this script did not write: '$(head -n1 <<<"$theirs")' (fix: merge '$line' into it by hand, or remove it and run this again)" >&2
  exit 1
elif [[ -n $theirs || $current == "$line" ]]; then
  echo "ok: $EXPORTS already exports $EXPORT_DIR as wanted"
  # A run whose `exportfs -ra` failed after it wrote the line: the line is there, the export is not.
  if [[ $NO_SYSTEM != 1 ]] && command -v exportfs >/dev/null && ! exportfs -s 2>/dev/null | awk -v k="$EXPORT_DIR" '$1 == k { f = 1 } END { exit !f }'; then
    do_ "reload the exports (exportfs -ra): $EXPORT_DIR is in $EXPORTS but not exported" exportfs -ra
  fi
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
  replace() {
    touch "$EXPORTS"
    cp "$EXPORTS" "$EXPORTS.aura-backup"
    { awk -v k="$EXPORT_DIR" -v mark="$MARK" '
        $0 == mark { held = $0; next }
        held != "" { if ($1 == k) { held = ""; next } print held; held = "" }
        { print }
        END { if (held != "") print held }' "$EXPORTS.aura-backup"
      echo "$MARK"; echo "$line"; } >"$EXPORTS.tmp"
    write_over "$EXPORTS.tmp" "$EXPORTS"
  }
  if [[ -n $current ]]; then do_ "replace in $EXPORTS: '$current' -> '$line'" replace
  else do_ "add to $EXPORTS: '$line'" replace; fi
  if [[ $NO_SYSTEM != 1 ]]; then do_ "reload the exports (exportfs -ra)" exportfs -ra; fi
fi

# Fedora and RHEL install the server disabled: the share was written and never served.
if [[ $NO_SYSTEM != 1 ]] && command -v dnf >/dev/null && command -v systemctl >/dev/null && ! systemctl is-active --quiet nfs-server; then
  do_ "start the NFS server now and at boot (systemctl enable --now nfs-server)" systemctl enable --now nfs-server
fi

# 4. firewall: NFSv4 needs only TCP 2049 from the clients
# A firewall rule takes an address or a subnet: a host name (or a wildcard, a netgroup) is said, not passed on
# (ufw refused it, and under set -e every run stopped there, 2049 never opened).
is_address() { [[ $1 =~ ^[0-9.]+(/[0-9]+)?$ || ( $1 == *:* && $1 =~ ^[0-9A-Fa-f:.]+(/[0-9]+)?$ ) ]]; }
FIREWALLED=()
for c in "${CLIENTS[@]}"; do
  if is_address "$c"; then FIREWALLED+=("$c"); else NAMED+=("$c"); fi
done
if [[ $NO_SYSTEM != 1 && ${#NAMED[@]} -gt 0 ]] && { command -v ufw >/dev/null || command -v firewall-cmd >/dev/null; }; then
  echo "note: no firewall rule for ${NAMED[*]}: a rule takes an address or a subnet (fix: open TCP 2049 to its address yourself, or pass --clients ADDRESS)"
fi
if [[ $NO_SYSTEM != 1 ]] && command -v ufw >/dev/null && ufw status 2>/dev/null | grep -q "Status: active"; then
  for c in "${FIREWALLED[@]}"; do
    # The rule's source field whole: 192.168.1.5 is not covered by a rule for 192.168.1.50.
    if ! ufw status | awk -v c="$c" '$1 ~ /^2049/ && $2 == "ALLOW" && $NF == c { f = 1 } END { exit !f }'; then
      do_ "open TCP 2049 (NFSv4) to $c in ufw" ufw allow from "$c" to any port 2049 proto tcp
    fi
  done
fi

# firewalld (on by default on Fedora and RHEL) drops 2049 unless told: one rule per client, like ufw's.
if [[ $NO_SYSTEM != 1 ]] && command -v firewall-cmd >/dev/null && firewall-cmd --state >/dev/null 2>&1; then
  for c in "${FIREWALLED[@]}"; do
    family=ipv4; [[ $c == *:* ]] && family=ipv6
    rule="rule family=$family source address=$c port port=2049 protocol=tcp accept"
    # Saved and applied, each where it is missing: --reload would drop every rule an admin added for this boot only
    # (the rendezvous port opened with firewall-cmd --add-port, say).
    if ! firewall-cmd --permanent --query-rich-rule="$rule" >/dev/null 2>&1; then
      do_ "save TCP 2049 (NFSv4) to $c in firewalld" firewall-cmd --permanent --add-rich-rule="$rule"
    fi
    if ! firewall-cmd --query-rich-rule="$rule" >/dev/null 2>&1; then
      do_ "open TCP 2049 (NFSv4) to $c in firewalld now" firewall-cmd --add-rich-rule="$rule"
    fi
  done
fi

if [[ $changes == 0 ]]; then echo "nothing to change"; elif [[ $DRY == 1 ]]; then echo "dry run: $changes change(s) not made"; fi
