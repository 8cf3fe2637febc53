"""nfs_setup/: dry-run output and idempotence, against scratch exports/fstab files.

Exporting and mounting for real needs a kernel NFS server; AURA_NFS_NO_SYSTEM=1 skips the
package, exportfs and mount steps so the file editing and the reporting are what is tested."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.conftest import REPO

SERVER = REPO / "nfs_setup" / "server.sh"
CLIENT = REPO / "nfs_setup" / "client.sh"
MARK = "# aura_hpc nfs_setup: the next line is this script's (run it again to change it)"


def _run(script: Path, args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args], capture_output=True, text=True, env={**os.environ, "AURA_NFS_NO_SYSTEM": "1", **env}, timeout=60
    )


def test_server_dry_run_changes_nothing_then_apply_is_idempotent(tmp_path: Path) -> None:
    exports = tmp_path / "exports"
    exports.write_text("/other 10.0.0.0/8(ro)\n")
    export_dir = tmp_path / "srv" / "aura"
    args = ["--export", str(export_dir), "--clients", "192.168.1.0/24", "--clients", "10.0.0.5"]
    dry = _run(SERVER, [*args, "--dry-run"], AURA_NFS_EXPORTS=str(exports))
    assert dry.returncode == 0, dry.stderr
    line = f"{export_dir} 192.168.1.0/24(rw,sync,no_subtree_check) 10.0.0.5(rw,sync,no_subtree_check)"
    assert f"would: create {export_dir}" in dry.stdout and f"would: add to {exports}: '{line}'" in dry.stdout
    assert "dry run: 2 change(s) not made" in dry.stdout
    assert exports.read_text() == "/other 10.0.0.0/8(ro)\n" and not export_dir.exists()

    first = _run(SERVER, args, AURA_NFS_EXPORTS=str(exports))
    assert first.returncode == 0, first.stderr
    assert exports.read_text() == "/other 10.0.0.0/8(ro)\n" + MARK + "\n" + line + "\n" and export_dir.is_dir()
    again = _run(SERVER, [*args[:1], f"{export_dir}/", *args[2:]], AURA_NFS_EXPORTS=str(exports))  # a trailing / too
    assert again.returncode == 0 and "nothing to change" in again.stdout and "already exports" in again.stdout
    assert exports.read_text().count(str(export_dir)) == 1

    changed = _run(SERVER, ["--export", str(export_dir), "--clients", "192.168.2.0/24"], AURA_NFS_EXPORTS=str(exports))
    assert "replace in" in changed.stdout
    assert exports.read_text().splitlines() == ["/other 10.0.0.0/8(ro)", MARK, f"{export_dir} 192.168.2.0/24(rw,sync,no_subtree_check)"]
    assert (tmp_path / "exports.aura-backup").exists()


def test_a_line_of_the_admins_is_never_replaced_and_a_wide_export_needs_asking(tmp_path: Path) -> None:
    """Any line for the same directory or mount point was taken for the script's own and replaced: the
    admin's other clients lost the export, a NAS mount vanished from fstab (a continued line half left)."""
    exports, fstab = tmp_path / "exports", tmp_path / "fstab"
    admins = "/srv/aura 10.9.0.0/16(ro,sync,no_subtree_check) \\\n    10.8.0.5(rw,sync)\n"
    exports.write_text(admins)
    r = _run(SERVER, ["--export", "/srv/aura", "--clients", "192.168.1.0/24"], AURA_NFS_EXPORTS=str(exports))
    assert r.returncode == 1 and "in a line this script did not write" in r.stderr and "fix: merge" in r.stderr, r.stderr
    assert exports.read_text() == admins
    fstab.write_text(f"//nas/share {tmp_path / 'mnt'} cifs credentials=/root/.smb 0 0\n")
    before = fstab.read_text()
    r = _run(CLIENT, ["--server", "192.168.1.10", "--export", "/srv/aura", "--mount", str(tmp_path / "mnt")], AURA_NFS_FSTAB=str(fstab))
    assert r.returncode == 1 and "choose another --mount" in r.stderr and fstab.read_text() == before, r.stderr
    for wide in (["--clients", "*"], ["--clients", "10.0.0.0/8", "--options", "rw,no_root_squash"]):
        r = _run(SERVER, ["--export", "/srv/x", *wide], AURA_NFS_EXPORTS=str(exports))
        assert r.returncode == 2 and "--allow-wide" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = _run(SERVER, ["--export", str(tmp_path / "x"), "--clients", "*", "--allow-wide", "--dry-run"], AURA_NFS_EXPORTS=str(exports))
    assert r.returncode == 0 and "would: add to" in r.stdout
    # Halves of the internet were "narrow"; two clients in one value gave the first exportfs's read-only defaults;
    # options in parentheses slipped past the no_root_squash check.
    for clients in (["0.0.0.0/1", "128.0.0.0/1"], ["2000::/3"]):
        r = _run(SERVER, ["--export", "/srv/x", *[a for c in clients for a in ("--clients", c)]], AURA_NFS_EXPORTS=str(exports))
        assert r.returncode == 2 and "--allow-wide" in r.stderr, r.stderr
    for odd in ("192.168.1.10 192.168.1.11", "192.168.1.5(rw,no_root_squash)"):
        r = _run(SERVER, ["--export", "/srv/x", "--clients", odd, "--allow-wide"], AURA_NFS_EXPORTS=str(exports))
        assert r.returncode == 2 and "is not one subnet, address or host name" in r.stderr and "(fix: one --clients per client" in r.stderr
    r = _run(SERVER, ["--export", "/srv/x", "--clients", "10.0.0.5", "--options", "rw sync"], AURA_NFS_EXPORTS=str(exports))
    assert r.returncode == 2 and "is not a comma-separated list of export options" in r.stderr, r.stderr
    # An admin's fstab line for the same mount point written with a trailing slash is theirs: no second line.
    fstab.write_text(f"nas:/vol {tmp_path / 'mnt2'}/ nfs defaults 0 0\n")
    r = _run(CLIENT, ["--server", "192.168.1.10", "--export", "/srv/aura", "--mount", str(tmp_path / "mnt2")], AURA_NFS_FSTAB=str(fstab))
    assert r.returncode == 1 and "choose another --mount" in r.stderr and fstab.read_text().count("mnt2") == 1, r.stderr


def test_client_dry_run_and_idempotent_fstab(tmp_path: Path) -> None:
    fstab = tmp_path / "fstab"
    fstab.write_text("UUID=abc / ext4 defaults 0 1\n")
    mount = tmp_path / "shared" / "aura"
    args = ["--server", "192.168.1.10", "--export", "/srv/aura", "--mount", str(mount)]
    dry = _run(CLIENT, [*args, "--dry-run"], AURA_NFS_FSTAB=str(fstab))
    assert dry.returncode == 0, dry.stderr
    line = f"192.168.1.10:/srv/aura {mount} nfs4 rw,hard,noatime,_netdev,nofail,x-systemd.automount,x-systemd.mount-timeout=15 0 0"
    assert f"would: add to {fstab}: '{line}'" in dry.stdout and fstab.read_text() == "UUID=abc / ext4 defaults 0 1\n" and not mount.exists()
    assert _run(CLIENT, args, AURA_NFS_FSTAB=str(fstab)).returncode == 0
    assert fstab.read_text().splitlines() == ["UUID=abc / ext4 defaults 0 1", MARK, line]
    again = _run(CLIENT, args, AURA_NFS_FSTAB=str(fstab))
    assert "nothing to change" in again.stdout and fstab.read_text().count(str(mount)) == 1


def test_bad_arguments_are_one_line_with_the_fix() -> None:
    for script, args in (
        (SERVER, ["--export", "relative/dir", "--clients", "x"]),
        (SERVER, []),
        (CLIENT, ["--server", "a"]),
        (SERVER, ["--bogus"]),
        (SERVER, ["--export"]),  # a flag without its value: bash's "$2: unbound variable" before
    ):
        res = _run(script, args)
        assert res.returncode == 2 and res.stderr.startswith("error:") and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_a_line_written_by_a_run_whose_exportfs_failed_is_exported_by_the_next_run(tmp_path: Path) -> None:
    """The first run wrote /etc/exports and then `exportfs -ra` failed (the NFS server stopped): the line is
    there, the export is not, and a re-run said "nothing to change". No kernel NFS server here: `exportfs`
    on PATH is a stand-in that fails or succeeds as told and answers `-s` with what it exported."""
    bin_dir, table = tmp_path / "bin", tmp_path / "exported"
    bin_dir.mkdir()
    fake = bin_dir / "exportfs"
    fake.write_text(
        "#!/bin/bash\n"
        f"if [[ $1 == -s ]]; then cat {table} 2>/dev/null; exit 0; fi\n"
        f'if [[ -e {tmp_path}/broken ]]; then echo "exportfs: could not open /proc/fs/nfs" >&2; exit 1; fi\n'
        f"awk '$0 !~ /^#/ {{ print }}' {tmp_path}/exports > {table}\n"
    )
    fake.chmod(0o755)
    exports, export_dir = tmp_path / "exports", tmp_path / "srv"
    exports.write_text("")
    env = {"AURA_NFS_EXPORTS": str(exports), "AURA_NFS_NO_SYSTEM": "0", "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    args = ["--export", str(export_dir), "--clients", "192.168.1.0/24"]
    (tmp_path / "broken").touch()
    first = _run(SERVER, args, **env)
    assert first.returncode != 0 and "could not open" in first.stderr and str(export_dir) in exports.read_text()
    (tmp_path / "broken").unlink()
    again = _run(SERVER, args, **env)
    assert again.returncode == 0, again.stderr
    assert f"doing: reload the exports (exportfs -ra): {export_dir} is in {exports} but not exported" in again.stdout, again.stdout
    assert table.read_text().split()[0] == str(export_dir)
    third = _run(SERVER, args, **env)
    assert third.returncode == 0 and "nothing to change" in third.stdout, third.stdout


def test_blank_paths_an_admins_trailing_slash_and_an_owner_by_name_are_understood(tmp_path: Path) -> None:
    """A blank split the exports and fstab lines (and each run added another); an admin's `/srv/aura/` was not seen as
    the same directory (a second export was added); `--owner ana:ana` never matched stat's numbers (chown every run)."""
    import grp
    import pwd

    exports, fstab = tmp_path / "exports", tmp_path / "fstab"
    for script, args in (
        (SERVER, ["--export", str(tmp_path / "my share"), "--clients", "192.168.1.0/24"]),
        (CLIENT, ["--server", "192.168.1.10", "--export", "/srv/aura", "--mount", str(tmp_path / "my mount")]),
    ):
        r = _run(script, args, AURA_NFS_EXPORTS=str(exports), AURA_NFS_FSTAB=str(fstab))
        assert r.returncode == 2 and "blank" in r.stderr and "(fix: " in r.stderr, r.stderr
    assert not exports.exists() and not fstab.exists()
    exports.write_text(f"{tmp_path / 'srv'}/ 10.9.0.0/16(rw,sync)\n")
    r = _run(SERVER, ["--export", str(tmp_path / "srv"), "--clients", "192.168.1.0/24"], AURA_NFS_EXPORTS=str(exports))
    assert r.returncode == 1 and "in a line this script did not write" in r.stderr, r.stdout + r.stderr
    owned = tmp_path / "owned"
    owned.mkdir()
    names = f"{pwd.getpwuid(os.getuid()).pw_name}:{grp.getgrgid(os.getgid()).gr_name}"
    args = ["--export", str(owned), "--clients", "192.168.1.0/24", "--owner", names]
    assert _run(SERVER, args, AURA_NFS_EXPORTS=str(tmp_path / "exports2")).returncode == 0
    again = _run(SERVER, [*args, "--dry-run"], AURA_NFS_EXPORTS=str(tmp_path / "exports2"))
    assert again.returncode == 0 and "chown" not in again.stdout and "nothing to change" in again.stdout, again.stdout


def test_the_firewall_step_opens_2049_to_addresses_and_names_the_clients_it_cannot(tmp_path: Path) -> None:
    """`ufw allow from node1` is refused (a rule takes an address): under `set -e` every run stopped there, after
    /etc/exports was written, and 2049 was never opened. A stand-in ufw (the real one needs root and a kernel
    firewall) records what the script asks of it."""
    bin_dir, asked = tmp_path / "bin", tmp_path / "ufw.log"
    bin_dir.mkdir()
    (bin_dir / "ufw").write_text(f'#!/bin/sh\nif [ "$1" = status ]; then echo "Status: active"; exit 0; fi\necho "$@" >> {asked}\n')
    (bin_dir / "exportfs").write_text("#!/bin/sh\nexit 0\n")
    for tool in ("ufw", "exportfs"):
        (bin_dir / tool).chmod(0o755)
    args = ["--export", str(tmp_path / "srv"), "--clients", "192.168.1.0/24", "--clients", "node1", "--clients", "fd00::/64"]
    env = {"AURA_NFS_NO_SYSTEM": "0", "AURA_NFS_EXPORTS": str(tmp_path / "exports"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = _run(SERVER, args, **env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert asked.read_text().splitlines() == [
        "allow from 192.168.1.0/24 to any port 2049 proto tcp",
        "allow from fd00::/64 to any port 2049 proto tcp",
    ]
    assert "note: no firewall rule for node1: a rule takes an address or a subnet (fix: open TCP 2049" in r.stdout, r.stdout


def test_the_files_it_edits_keep_their_mode_and_links_and_firewalld_keeps_its_runtime_rules(tmp_path: Path) -> None:
    """Renamed over /etc/exports, the new file took the umask's mode (077: 0600, unreadable to the NFS daemons' user
    where they drop root), a link to it became a plain file, and SELinux's label went. firewall-cmd --reload dropped
    every rule an admin had added for this boot only."""
    real = tmp_path / "etc" / "exports.real"
    real.parent.mkdir()
    real.write_text("/srv/other 10.0.0.9(ro)\n")
    real.chmod(0o644)
    link = tmp_path / "etc" / "exports"
    link.symlink_to(real)
    bin_dir, asked = tmp_path / "bin", tmp_path / "fw.log"
    bin_dir.mkdir()
    (bin_dir / "firewall-cmd").write_text(f'#!/bin/sh\necho "$@" >> {asked}\ncase "$*" in *query*) exit 1;; esac\nexit 0\n')
    (bin_dir / "exportfs").write_text("#!/bin/sh\nexit 0\n")
    for tool in ("firewall-cmd", "exportfs"):
        (bin_dir / tool).chmod(0o755)
    env = {"AURA_NFS_NO_SYSTEM": "0", "AURA_NFS_EXPORTS": str(link), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = subprocess.run(
        ["bash", "-c", f'umask 077; exec bash "{SERVER}" --export "{tmp_path / "srv"}" --clients 192.168.1.0/24'],
        capture_output=True, text=True, env={**os.environ, **env}, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert link.is_symlink() and (real.stat().st_mode & 0o777) == 0o644, oct(real.stat().st_mode)
    assert "/srv/other 10.0.0.9(ro)" in real.read_text() and "192.168.1.0/24" in real.read_text()
    said = asked.read_text()
    assert "--reload" not in said and "--permanent --add-rich-rule=" in said, said
    assert any(ln.startswith("--add-rich-rule=") for ln in said.splitlines()), said


def test_a_copy_cut_short_leaves_the_file_as_it_was_and_stops_the_script(tmp_path: Path) -> None:
    """`cp ... && rm ...` under set -e: a cp cut short by a full disk did not stop the script, and the cut copy was
    renamed over /etc/exports (over /etc/fstab: a machine that may not boot)."""
    exports = tmp_path / "exports"
    exports.write_text("/srv/other 10.0.0.9(ro)\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # The copy that replaces the file gets 8 bytes, then a full disk; every other copy is the real cp's.
    shim = '#!/bin/sh\nfor last; do :; done\ncase "$last" in *.aura-new) printf "/srv/oth" > "$last"; exit 1;; esac\nexec /bin/cp "$@"\n'
    (bin_dir / "cp").write_text(shim)
    (bin_dir / "cp").chmod(0o755)
    env = {"AURA_NFS_EXPORTS": str(exports), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = _run(SERVER, ["--export", str(tmp_path / "srv"), "--clients", "192.168.1.0/24"], **env)
    assert r.returncode != 0 and "is unchanged" in r.stderr, r.stdout + r.stderr
    assert exports.read_text() == "/srv/other 10.0.0.9(ro)\n" and not list(tmp_path.glob("exports.aura-new"))
