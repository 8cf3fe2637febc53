"""`ps` (the parameter server PC) and `worker` (every other PC): asynchronous training over a LAN."""

from __future__ import annotations

import argparse
import shlex

from aura_hpc.cli.common import add_run_options


def cmd_ps(a: argparse.Namespace) -> int:
    from aura_hpc import console
    from aura_hpc.launch.run_setup import prepare_run_dir
    from aura_hpc.ps import auth
    from aura_hpc.ps.commands import lan_addresses, load_ps_config, worker_command
    from aura_hpc.train.process import worker_log

    cfg = load_ps_config(a.config, a.overrides, a.output_dir, a.run_name, a.port, a.workers)
    auth.given_secret(a.secret_file)  # a bad secret is refused before the run directory is touched
    from aura_hpc.ops.network import port_in_use

    if port_in_use(cfg.ps.port):  # before the worker command is printed, the run folder made or a secret written
        from aura_hpc.errors import LaunchError

        raise LaunchError(
            f"port {cfg.ps.port} is already in use on this machine (fix: --port {cfg.ps.port + 1} here and in the workers' "
            "--server, or stop the program using it)"
        )
    lock = prepare_run_dir(cfg, 1, lock=True, secret=False)
    assert lock is not None
    try:
        from aura_hpc.train.process.startup_gc import imports_unscanned

        with imports_unscanned():
            from aura_hpc.ps.server import ParameterServer

        secret, origin = auth.server_secret(cfg.run_dir, a.secret_file)
        addrs = lan_addresses()
        console.heading(
            f"aura_hpc ps: run {cfg.run_name!r}, parameter server on port {cfg.ps.port} for {cfg.ps.workers} workers "
            f"(this PC: {', '.join(addrs)})"
        )
        console.info(
            "on each worker PC, from any folder (add --worker-rank K to choose its shard, 1..N); the run's secret "
            f"({origin}) proves every join and message, so keep this line private:"
        )
        command = worker_command(addrs[0], cfg.ps.port, a.config, a.overrides, a.run_name)
        # Quoted for the shell it is pasted into: a chosen secret with `$` or `;` arrived changed, or ran a command.
        if a.secret_file:
            console.info("copy that secret file to each worker PC, then run there:")
            console.plain(f"  {command} --secret-file {shlex.quote(str(a.secret_file))}")
        else:
            console.plain(f"  {auth.SECRET_ENV}={shlex.quote(secret)} {command}")
        console.info(f"open TCP port {cfg.ps.port} on this PC's firewall for the workers; Ctrl+C here saves and stops them all")
        worker_log.setup(cfg.run_dir / "logs", 0, label="ps")
        from aura_hpc.train.process.progress import STACK_SIGNAL

        # A seat that never leaves (a worker thread stuck where no error reaches it): `kill -WINCH <pid>`
        # writes every thread's stack into logs/ps.log, as a worker rank's watchdog asks of it.
        worker_log.dump_stacks_on(STACK_SIGNAL)
        server = ParameterServer(cfg, auth.key_of(secret))
        server.resume()
        from aura_hpc.launch.native_stderr import native_stderr_to

        # torch's C++ store prints its own traces (a peer that sends what it refuses): to a file, not this terminal.
        with native_stderr_to(cfg.run_dir / "logs" / "stderr_ps.log"):
            return server.serve(cfg.ps.port)
    finally:
        lock.release()


def cmd_worker(a: argparse.Namespace) -> int:
    from aura_hpc import console
    from aura_hpc.launch.run_setup import ensure_data
    from aura_hpc.ps import auth
    from aura_hpc.ps.commands import load_ps_config
    from aura_hpc.train.process import worker_log
    from aura_hpc.train.process.startup_gc import imports_unscanned

    # The config and the secret first: a typo in --set was said after torch's import (seconds), not at once.
    cfg = load_ps_config(a.config, a.overrides, a.output_dir, a.run_name, None, None)
    key = auth.key_of(auth.worker_secret(a.secret_file))
    with imports_unscanned():
        from aura_hpc.ps.worker import PsWorker, parse_server

    addr, port = parse_server(a.server, cfg.ps.port)
    if a.worker_rank is not None and a.worker_rank < 1:
        from aura_hpc.errors import LaunchError

        raise LaunchError(f"--worker-rank must be 1 or more, got {a.worker_rank} (fix: --worker-rank 1, or omit it)")
    ensure_data(cfg, 1)
    console.heading(f"aura_hpc worker: run {cfg.run_name!r}, parameter server {addr}:{port}")
    worker_log.setup(None, 0, label="worker")
    w = PsWorker(cfg, addr, port, a.worker_rank or 0, key)
    from aura_hpc.launch.native_stderr import native_stderr_to

    # torch's C++ store and gloo warnings (a server that answers slowly): to a file, not this terminal.
    with native_stderr_to(cfg.run_dir / "logs" / "stderr_worker.log"):
        return w.run(console.info, lambda rank: worker_log.setup(cfg.run_dir / "logs", rank, label=f"worker{rank}"))


def add(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "ps",
        help="asynchronous training: run the parameter server on this PC (workers join with `worker`)",
        description="Hold the model and optimizer, apply each worker's gradient as it arrives (no waiting for slow PCs). "
        "Prints its LAN address and the exact worker command. Ctrl+C saves and stops the workers; re-running resumes.",
    )
    add_run_options(p, screen=False)  # nothing under ps/ runs the screen
    p.add_argument("--workers", type=int, help="how many worker PCs the data is split for (default: ps.workers, 2)")
    p.add_argument("--port", type=int, help="TCP port the workers connect to (default: ps.port, 30005)")
    p.add_argument("--secret-file", help="a file holding the run's secret (default: AURA_PS_SECRET, else RUN_DIR/ps.secret, made once)")
    p.set_defaults(func=cmd_ps)

    p = sub.add_parser(
        "worker",
        help="asynchronous training: join a parameter server from this PC",
        description="Train on this PC's shard of the data and exchange gradients/weights with the parameter server. "
        "Use the same --config/--set as the server (it checks). Ctrl+C leaves; the others go on.",
    )
    add_run_options(p, screen=False)  # nothing under ps/ runs the screen
    p.add_argument("--server", required=True, help="the server's ADDR or ADDR:PORT (printed by `ps`)")
    p.add_argument("--worker-rank", type=int, help="this worker's rank 1..N (default: the server gives a free one)")
    p.add_argument("--secret-file", help="a file holding the run's secret (default: the AURA_PS_SECRET variable, as `ps` prints)")
    p.set_defaults(func=cmd_worker)
