"""What `ps` and `worker` do before and after training: config, data, run directory, the lines a
user needs (the server's addresses and the exact worker command), and the logs."""

from __future__ import annotations

import shlex
from pathlib import Path

from aura_hpc.config import RunConfig, load_config, max_steps_for
from aura_hpc.config.tracking import backends
from aura_hpc.errors import ConfigError


def load_ps_config(
    config: str | None, overrides: list[str], output_dir: str | None, run_name: str | None, port: int | None, workers: int | None
) -> RunConfig:
    extra = [f"ps.port={port}"] if port is not None else []
    extra += [f"ps.workers={workers}"] if workers is not None else []
    cfg = load_config(config, [*overrides, *extra], output_dir, run_name)
    cfg.output_dir = str(Path(cfg.output_dir).expanduser().resolve())
    if cfg.data.path.startswith("s3://"):
        raise ConfigError(
            "the parameter server and its workers read a local prepared directory, not s3:// (fix: copy it to each machine, "
            "e.g. aws s3 sync, and --set data.path=THAT_FOLDER)"
        )
    if cfg.data.path:
        cfg.data.path = str(Path(cfg.data.path).expanduser().resolve())
    if cfg.health.screen != "skip":  # --screen: nothing under ps/ runs the screen
        raise ConfigError(
            "the parameter server and its workers run no GPU screen (fix: drop --screen; `python -m aura_hpc check` tests a machine)"
        )
    if cfg.train.stop_at:
        raise ConfigError(
            "train.stop_at is not used by the parameter server (fix: drop it; Ctrl+C on the server saves, re-running resumes)"
        )
    others = [b for b in backends(cfg) if b != "tensorboard"]
    if others:  # the server writes metrics.jsonl and TensorBoard; nothing here would start a tracker
        raise ConfigError(
            f"the parameter server logs to metrics.jsonl and TensorBoard only; tracking.backends asks for {', '.join(others)} "
            "(fix: --set tracking.backends=tensorboard; `local` and `submit` runs log to the other trackers)"
        )
    if cfg.dist.strategy != "ddp":
        raise ConfigError(
            f"dist.strategy {cfg.dist.strategy} shards a model over synchronous ranks; the parameter server holds it whole "
            "(fix: --set dist.strategy=ddp, or use `local`/`submit` for sharded training)"
        )
    if cfg.train.precision == "fp16":  # it said "fp16 needs a CUDA GPU" on a server PC that has one
        raise ConfigError(
            "train.precision fp16 is not for the parameter server: its model copy trains on the CPU, and a worker's "
            "gradients have no loss scaling to keep them from underflowing (fix: --set train.precision=bf16, or auto)"
        )
    # A token budget counts server updates: each applies one worker's ps.push_every batches (counted as 1, the run
    # trained push_every times its budget).
    cfg.train.max_steps = max_steps_for(cfg, cfg.ps.push_every)
    cfg.train.max_tokens = 0
    return cfg


def lan_addresses() -> list[str]:
    """This PC's IPv4 addresses that LAN workers can use (private ranges first), or loopback alone."""
    import ipaddress

    import psutil

    found = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family.name == "AF_INET" and not ipaddress.ip_address(a.address).is_loopback:
                found.append(a.address)
    found.sort(key=lambda ip: not ipaddress.ip_address(ip).is_private)
    return found or ["127.0.0.1"]


def worker_command(addr: str, port: int, config: str | None, overrides: list[str], run_name: str | None) -> str:
    words = ["python", "-m", "aura_hpc", "worker", "--server", f"{addr}:{port}"]
    if config:
        words += ["--config", config]
    for o in overrides:
        if not o.startswith(("ps.port=", "ps.workers=")):
            words += ["--set", o]
    if run_name:
        words += ["--run-name", run_name]
    return shlex.join(words)
