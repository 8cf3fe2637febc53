"""`check --shared-dir`: whether every node sees one directory (the NFS export output_dir must be), written and read
back by every node, with the fix for what it is instead (a local folder, a missing mount, permissions)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import uuid
from pathlib import Path
from typing import Any

from aura_hpc.comm import collectives
from aura_hpc.ops.check_report import Report
from aura_hpc.ops.check_store import peer_token

PERMISSION = ": permission denied"
STRANGER = "the folder name node 0 published is not one `check` makes (another program wrote into its port)"


def shared_dir(report: Report, a: Any, store: Any, nodes: list[dict[str, Any]]) -> None:

    root = Path(a.shared_dir or ".").expanduser()
    token = peer_token(store) if a.node_rank else uuid.uuid4().hex
    if a.node_rank == 0:
        store.set("shared-token", token)
    where = root / ".aura-check" / (token or "refused")
    error = "" if token else STRANGER
    if not error and not root.is_dir():  # made here, it was a local folder where the NFS mount was meant to be
        error = f"{root} does not exist (mount the shared export there first)"
    try:
        if not error:
            where.mkdir(parents=True, exist_ok=True)
            uid = os.getuid() if hasattr(os, "getuid") else None
            (where / f"node{a.node_rank}").write_text(json.dumps({"node_rank": a.node_rank, "uid": uid, "token": token}))
    except OSError as exc:
        error = f"cannot write in {root} ({exc.strerror})"
        if exc.errno in (errno.EACCES, errno.EPERM):  # root_squash, or another uid owns it: not a missing mount
            error += PERMISSION
    collectives.barrier()
    seen, foreign_owner = [], []
    if not error:
        for r, n in enumerate(nodes):
            f = where / f"node{r}"
            try:  # an NFS error (ESTALE, EACCES) here left this node out of the collectives below, the others waiting
                st = f.stat()
            except FileNotFoundError:
                continue
            except OSError as exc:
                error = f"cannot read in {root} ({exc.strerror})"
                break
            seen.append(r)
            if n["uid"] is not None and st.st_uid != n["uid"]:
                foreign_owner.append(f"node {r}'s file is owned by uid {st.st_uid}, not {n['uid']}")
    results = collectives.gather_json({"error": error, "seen": seen, "owners": foreign_owner})
    with contextlib.suppress(OSError):
        (where / f"node{a.node_rank}").unlink(missing_ok=True)
    collectives.barrier()
    # Every node removes what it wrote, then the folders if they are empty (another user's or run's stay): on
    # nodes that did not share the folder, node 0 alone left each other node its own behind.
    if not error:
        for folder in (where, where.parent):
            with contextlib.suppress(OSError):
                folder.rmdir()
    problems = []
    for r, res in enumerate(results):
        if res["error"]:
            problems.append(f"node {r}: {res['error']}")
        elif sorted(res["seen"]) != list(range(a.nnodes)):
            unseen = sorted(set(range(a.nnodes)) - set(res["seen"]))
            problems.append(f"node {r} does not see the files of node(s) {', '.join(map(str, unseen))}")
    if problems:
        report.add(
            "shared dir",
            False,
            f"{root} is not one shared directory: " + "; ".join(problems),
            "run the check again on a port only your machines reach (--master-port)"
            if any(STRANGER in p for p in problems)
            else "give the training user write access there (the same uid on every node; NFS's root_squash maps root to nobody)"
            if any(PERMISSION in p for p in problems)
            else "mount the same NFS export at this path on every node (see nfs_setup/) and pass that path",
        )
        return
    uids = {n["uid"] for n in nodes}
    owners = [o for res in results for o in res["owners"]]
    if len(uids) > 1 or owners:
        detail = f"users differ: uid {sorted(uids)}" if len(uids) > 1 else "; ".join(owners[:2])
        report.add(
            "shared dir",
            False,
            f"{root} is shared but {detail}",
            "use the same UID/GID for the training user on every node (NFS matches numbers, not names); root_squash maps root to nobody",
        )
        return
    report.add(
        "shared dir", True, f"{root} is the same directory on all {a.nnodes} nodes, same uid/gid {nodes[0]['uid']}/{nodes[0]['gid']}"
    )
