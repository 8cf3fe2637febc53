"""The trackers themselves, each behind the same four calls (start, log, finish, hint), all made from
the trackers' thread (trackers.py). Imported only when a run asks for one: none is a base dependency."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import string
import sys
import time
from pathlib import Path
from typing import Any

from aura_hpc.config import RunConfig

log = logging.getLogger("aura_hpc")

# What points trackio.init at a Space or a server instead of its local store (the last two on a Space only).
ONLINE_TRACKIO = ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "TRACKIO_BUCKET_ID", "TRACKIO_DATASET_ID")


def make(name: str, cfg: RunConfig, local: Path, folder: Path, run_key: str = "") -> Any:
    """`run_key`: this run directory's own (RUN_DIR/tracking/ids.json): a run directory deleted and made again is another run."""
    backend = {"trackio": Trackio, "wandb": Wandb, "mlflow": Mlflow}[name](cfg, local, folder)
    backend.run_key = run_key
    return backend


def chosen_id(name: str, cfg: RunConfig) -> str | None:
    """The id we give a new tracked run (MLflow's server gives its own: found again by RUN_KEY_TAG)."""
    if name == "wandb":
        return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    if name == "trackio":
        return cfg.run_name
    return None


# A run made by an attempt killed before it kept MLflow's id is found again by this tag. Its value is the run
# directory's random key, not its path: with a server or a database that outlives the directory, the path found a
# deleted run's record, and the new run's first steps were taken for ones it already held.
RUN_KEY_TAG = "aura_hpc.run_key"
RUN_DIR_TAG = "aura_hpc.run_dir"


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)[:500]
    return out


class Trackio:
    """Local-first: one SQLite file per project under TRACKIO_DIR (here RUN_DIR/tracking/trackio, or its
    node-local copy); `trackio show` views it, `trackio sync` uploads it to a Space."""

    def __init__(self, cfg: RunConfig, local: Path, folder: Path) -> None:
        self.cfg, self.dir, self.kept = cfg, local / "trackio", folder / "trackio"

    def start(self, config: dict[str, Any], run_id: str | None, resume_step: int) -> str:
        os.environ["TRACKIO_DIR"] = str(self.dir)  # read by trackio once, at import
        # trackio.init sends every row to a Space or a server named in these (a shell profile exports them for
        # trackio used elsewhere), writing nothing here: an offline node lost its tracker, an online one its store.
        ignored = [v for v in ONLINE_TRACKIO if os.environ.pop(v, None)]
        if ignored:
            log.warning(
                "tracking: trackio writes to %s on this node; %s in the environment ignored (fix: `trackio sync` uploads the "
                "store to a Space after the run)",
                self.kept,
                ", ".join(ignored),
            )
        os.environ.setdefault("TRACKIO_SQLITE_MMAP_SIZE", "0")
        # One SQLite file, always: trackio's own "auto" writes JSONL fragments on a network filesystem,
        # which its resume does not read (each attempt would be a new run). Node-local is our way there.
        os.environ["TRACKIO_STORAGE_MODE"] = "sqlite"
        if self.dir == self.kept and _network(self.dir):  # sqlite_local=false on NFS: no WAL, no mmap (trackio #555)
            os.environ.setdefault("TRACKIO_SQLITE_JOURNAL_MODE", "delete")
        import trackio
        import trackio.run
        import trackio.utils

        if Path(trackio.utils.TRACKIO_DIR) != self.dir:
            raise RuntimeError(f"trackio was imported before with TRACKIO_DIR={trackio.utils.TRACKIO_DIR}, not {self.dir}")
        # Its run asks the Hugging Face Hub who the user is (whoami, no timeout) when a token is set: an
        # offline compute node would hang there. The user name is not ours to need.
        trackio.run._get_default_namespace = lambda: None

        _trackio_lines_to_the_log()
        name = run_id or self.cfg.run_name
        self.run = trackio.init(
            project=self.cfg.tracking.project,
            name=name,
            config=config,
            resume="allow",
            embed=False,
            auto_log_gpu=False,
            auto_log_cpu=False,
        )
        return name

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def finish(self, failed: bool) -> None:
        _trackio_lines_to_the_log()  # its modules imported since start
        self.run.finish()  # trackio keeps no run status

    def last_step(self) -> int | None:
        from trackio.sqlite_storage import SQLiteStorage

        return SQLiteStorage.get_max_step_for_run(self.cfg.tracking.project, self.run.name)

    def hint(self) -> str:
        return f"view with: TRACKIO_DIR={self.kept} trackio show --project {self.cfg.tracking.project} (or `trackio sync` to a Space)"


def _trackio_lines_to_the_log() -> None:
    """trackio prints to stdout ("* Trackio metrics logged to: <TRACKIO_DIR>", "* Run finished. Uploading
    logs to Trackio..."): bare lines among the ranks' prefixed ones on the terminal and in Slurm's log,
    naming the node-local folder that is removed at the end, and an upload that does not happen. They go
    to rank 0's log file instead; `hint()` says where the store is kept. A `print` in a module's namespace
    is the one its functions call."""
    from aura_hpc.train.process.worker_log import to_file_only

    def into_log(*args: object, **_kwargs: object) -> None:
        text = " ".join(str(a) for a in args).strip()
        if text:
            to_file_only(f"tracking: trackio said: {text}", exc_info=False)

    for name, module in list(sys.modules.items()):
        if module is not None and (name == "trackio" or name.startswith("trackio.")):
            with contextlib.suppress(AttributeError, TypeError):  # a module that takes no attribute keeps its own
                module.print = into_log  # type: ignore[attr-defined]


class Wandb:
    """W&B, offline unless tracking.wandb_mode=online: RUN_DIR/wandb/offline-run-*, `wandb sync` later.
    The run id is ours and kept, so every attempt's folder syncs into one run."""

    def __init__(self, cfg: RunConfig, local: Path, folder: Path) -> None:
        self.cfg, self.dir = cfg, cfg.run_dir

    def start(self, config: dict[str, Any], run_id: str | None, resume_step: int) -> str:
        mode = self.cfg.tracking.wandb_mode
        # Its telemetry (a POST to W&B's metrics endpoint at exit) and error reports read the global settings, not
        # init's mode: an offline run still went to the network, and an exit behind a firewall waited for it.
        os.environ["WANDB_MODE"] = mode
        if mode == "offline":
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        import wandb

        run_id = run_id or chosen_id("wandb", self.cfg)
        # Its offline file is written every 15 s by default: an attempt killed sooner left no run record, config included,
        # and W&B is the one tracker a resume does not fill in from metrics.jsonl. The file is local: every second.
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, x_transaction_log_flush_interval=1.0)
        self.run = wandb.init(
            project=self.cfg.tracking.project,
            id=run_id,
            name=self.cfg.run_name,
            dir=str(self.dir),
            config=config,  # in the run record, written before the first row (a killed offline run keeps it)
            resume="allow",
            mode=mode,
            settings=settings,
        )
        return run_id

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def finish(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)

    def last_step(self) -> int | None:
        return None  # an offline run's rows are in its service's files: not read back here

    def hint(self) -> str:
        if self.cfg.tracking.wandb_mode == "online":
            return f"W&B run {self.run.id} in project {self.cfg.tracking.project}"
        return f"sync with: wandb sync {self.dir / 'wandb'}/offline-run-*-{self.run.id} (every attempt of this run, into one W&B run)"


class Mlflow:
    """MLflow through its client (no global active run): a SQLite store in RUN_DIR/tracking/mlflow.db by
    default (the file store is deprecated and refused by MLflow 3.13 without MLFLOW_ALLOW_FILE_STORE)."""

    def __init__(self, cfg: RunConfig, local: Path, folder: Path) -> None:
        self.cfg, self.local, self.folder = cfg, local, folder
        self.uri = cfg.tracking.mlflow_uri or f"sqlite:///{local / 'mlflow.db'}"

    def _experiment(self, project: str) -> str:
        """The project's experiment, made if there is none. MLflow finds a deleted one by its name too, and refuses
        runs in it; and two jobs starting a new project together both made it, the second refused: MLflow was off."""
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(project)
        if exp is None:
            try:
                return str(self.client.create_experiment(project, artifact_location=str(self.folder / "mlflow-artifacts")))
            except MlflowException as exc:
                if "already exists" not in str(exc).lower() and getattr(exc, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
                    raise
                exp = self.client.get_experiment_by_name(project)  # another job made it meanwhile
        if exp is None or exp.lifecycle_stage == "deleted":
            found = f" (id {exp.experiment_id})" if exp is not None else ""
            raise RuntimeError(
                f"the MLflow experiment '{project}'{found} was deleted (fix: restore it with `mlflow experiments restore "
                f"--experiment-id {exp.experiment_id if exp else 'ID'}`, or --set tracking.project=ANOTHER)"
            )
        return str(exp.experiment_id)

    def start(self, config: dict[str, Any], run_id: str | None, resume_step: int) -> str:
        # An unreachable server fails in seconds (its default is minutes of retries, in our thread but
        # holding rows back): the queue and its warning take it from there.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        # MLflow 3 reports its use to its makers from every client (a lookup and posts from a compute node).
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        project = self.cfg.tracking.project
        exp_id = self._experiment(project)
        if run_id and not self._exists(run_id):  # a store lost (or another mlflow_uri): the kept id names nothing
            run_id = None
        if not run_id and self.run_key.isalnum():  # an attempt killed before it kept MLflow's id: found by its tag
            found = self.client.search_runs([exp_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{self.run_key}'", max_results=1)
            run_id = found[0].info.run_id if found else None
        if run_id:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            self.client.set_tag(run_id, "aura_hpc.resumed_at_step", str(resume_step))
        else:
            tags = {RUN_KEY_TAG: self.run_key, RUN_DIR_TAG: str(self.cfg.run_dir.resolve())}
            self.run_id = self.client.create_run(exp_id, run_name=self.cfg.run_name, tags=tags).info.run_id
        if not self.client.get_run(self.run_id).data.params:  # the settings it started with (MLflow never changes a param)
            params = [Param(k, v) for k, v in flat(config).items()]
            for i in range(0, len(params), 100):
                self.client.log_batch(self.run_id, params=params[i : i + 100])
        return self.run_id

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException as exc:
            if getattr(exc, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise
        return True

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # MLflow's metric names allow letters, digits, _ - . space / only.
        metrics = [Metric(k.replace(":", "_"), v, now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")

    def last_step(self) -> int | None:
        steps = [m.step for m in self.client.get_metric_history(self.run_id, "loss")]
        return max(steps) if steps else None

    def hint(self) -> str:
        if self.cfg.tracking.mlflow_uri:
            return f"MLflow run {self.run_id} at {self.cfg.tracking.mlflow_uri}"
        store = self.folder / "mlflow.db"
        return f"view with: mlflow server --backend-store-uri sqlite:///{store} (the full `mlflow` package), run {self.run_id}"


def _network(path: Path) -> bool:
    from aura_hpc.ops.disk import is_network_fs

    return is_network_fs(path)
