"""The config tree: one dataclass per section, the allowed values, and the section table.

No imports from the rest of the package beyond errors: the CLI loads and validates configs
before deciding whether any heavy machinery is needed at all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# NVML clocks-event reasons the GPU circuit breaker can act on (their bits live in
# aura_hpc.ops.gpu_health, which checks that it knows every name listed here).
THROTTLE_REASONS = ("sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake")


WEBHOOK_SECRET_ENV = "AURA_WEBHOOK_URL"
REDACTED = "<redacted>"


def is_literal_url(url: str) -> bool:
    return url.startswith(("http://", "https://")) and REDACTED not in url


def redacted_url(url: str) -> str:
    """Scheme and host only: the path, the query, a fragment and any user:password usually hold the token."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:  # a port that is not a number: nothing of it is kept
        return f"{url.partition('://')[0]}://{REDACTED}"
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}{port}/{REDACTED}"


@dataclass
class ModelConfig:
    preset: str = "tiny"  # a shipped config whose model section is the base of this one (`config --list`: tiny, gpt2-small, ...)
    n_layer: int = 2  # transformer blocks
    n_embd: int = 128  # the model width (hidden size)
    n_head: int = 4  # attention heads (must divide n_embd)
    n_positions: int = 256  # the longest sequence the model takes (at least data.seq_len)
    vocab_size: int = 0  # 0: take the vocabulary size of the prepared data's tokenizer
    padded_vocab_size: int = 0  # > 0: embedding rows, at least the tokenizer's (e.g. 50304: multiples of 64/128 run faster)
    dropout: float = 0.0  # dropout of embeddings, attention and residual outputs


@dataclass
class DataConfig:
    path: str = ""  # prepared directory, local or s3://bucket/prefix; "" = the package's own Spanish corpus
    seq_len: int = 128  # tokens per training sequence
    vocab_size: int = 4096  # used only when `local` or `submit` prepares the built-in corpus
    shuffle_window: int = 0  # shards shuffled together: 0 = all (a full shuffle); N = a node needs only about 2N shards at a time
    cache_dir: str = ""  # where each node keeps shards read from s3:// or streamed; "" = /tmp/aura_hpc-cache-USER
    cache_gb: float = 100.0  # the bound on that cache (GiB); least recently used shards go first (a stream's: encoded longest ago)
    read_tries: int = 5  # attempts per object-storage read, with exponential backoff between them
    read_timeout_s: float = 60.0  # the limit on one attempt (connecting, then reading)
    stream: bool = False  # train from data.path's raw text (local or s3://) or data.dataset, tokenized on the fly
    dataset: str = ""  # with data.stream: a Hugging Face dataset name (or local dataset folder) to stream
    dataset_subset: str = ""  # that dataset's configuration/subset
    dataset_split: str = "train"  # that dataset's split
    dataset_revision: str = ""  # that Hub dataset's commit (or tag, branch): pinned, a resumed run reads the text it began on
    text_column: str = "text"  # the text column of JSON lines, Parquet or a dataset
    tokenizer: str = ""  # with data.stream: a tokenizer folder (or a prepared directory) to encode with
    shard_mb: float = 64.0  # with data.stream: raw text per piece, each encoded when first needed
    val_fraction: float = 0.01  # with data.stream: share of text kept for validation


@dataclass
class TrainConfig:
    max_steps: int = 150  # optimizer steps to train (the schedule horizon)
    max_tokens: int = 0  # > 0: derive max_steps from a token budget instead
    stop_at: int = 0  # > 0: checkpoint and stop at this step; re-run to continue
    batch_size: int = 8  # sequences per device per micro-step
    grad_accum: int = 1  # micro-steps accumulated into one optimizer step
    lr: float = 1e-3  # AdamW's peak learning rate
    min_lr_ratio: float = 0.1  # the learning rate at the end of the schedule, as a share of train.lr
    warmup_steps: int = 15  # steps of linear warmup (clamped to the run, with a warning)
    schedule: str = "cosine"  # the decay after warmup
    optimizer: str = "adamw"  # adamw (decoupled weight decay) or sgd
    weight_decay: float = 0.1  # AdamW's weight decay (matrices only; biases and norms get none)
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    grad_clip: float = 1.0  # clip the total gradient norm to this (0: no clipping)
    precision: str = "auto"  # auto: bf16 autocast on GPUs with native bf16 (compute capability 8.0+), fp32 elsewhere
    seed: int = 1234  # the seed of the weights, the data order and dropout
    log_every: int = 10  # steps between two log lines and metrics rows
    eval_every: int = 50  # steps between two evaluations (0: none)
    eval_batches: int = 4  # validation batches per evaluation (train.eval_sequences = this x batch_size when 0)
    eval_sequences: int = 0  # N validation sequences spread over the split, whatever the world size; 0 = eval_batches x batch_size
    checkpoint_every: int = 50  # steps between two checkpoints (0: only at the end and on signals)
    checkpoint_every_s: float = 600.0  # also one at the first logged step this long after the last (0: off); rank 0's clock decides
    keep_last: int = 3  # checkpoints kept (plus the best by validation loss)
    sample_every: int = 0  # 0: only a final sample
    sample_prompt: str = "En un lugar de la Mancha"  # the text samples continue (with sample_tokens it must fit model.n_positions)
    sample_tokens: int = 40  # tokens generated per sample
    allow_oversubscription: bool = False  # repeat the data when it holds fewer sequences than one effective batch
    threads: int = 0  # torch intra-op threads per process; 0 = launcher's OMP_NUM_THREADS
    tune_malloc: bool = True  # CPU training: fixed glibc mmap/trim thresholds (see aura_hpc/train/process/malloc_tuning.py)
    compile: str = "auto"  # torch.compile of the transformer blocks: auto (on for CUDA except zero1/2/3 and ps; off on CPUs) | true | false
    loss: str = "auto"  # cross-entropy: auto (chunked on CUDA except under fp16, full on CPU) | chunked (no full fp32 logits) | full
    activation_checkpointing: bool = False  # recompute each block's activations in the backward pass (less memory)
    fused_optimizer: str = "auto"  # fused AdamW (one kernel; a bad step skipped on the device): auto (CUDA) | true | false
    async_checkpoint: bool = True  # write checkpoints in a background thread after copying the state to host memory
    nan_rollback_after: int = 3  # consecutive non-finite steps (skipped) before rolling back
    nan_lr_scale: float = 0.5  # multiply the learning rate by this at each rollback (1 = keep)
    nan_max_rollbacks: int = 3  # then stop: the run diverges


@dataclass
class DistConfig:
    backend: str = "auto"  # the process group: auto (nccl on GPUs, gloo on CPU, gloo if NCCL fails everywhere), nccl, gloo
    strategy: str = "ddp"  # ddp | fsdp (FSDP2) | zero1 | zero2 | zero3 (DeepSpeed) | diloco (replicas that meet every sync_every steps)
    fsdp_cpu_offload: bool = False  # fsdp: parameters, gradients and optimizer state in host memory between uses
    zero_offload_optimizer: bool = False  # zero1-3: DeepSpeed keeps the optimizer state (and its step) in host memory
    deepspeed_config: str = ""  # zero1-3: your DeepSpeed JSON, merged under what the trainer sets (conflicts refused)
    compress: str = "none"  # ddp over a slow link: none | bf16 (gradients halved on the wire) | powersgd (low-rank, error feedback)
    powersgd_rank: int = 4  # dist.compress=powersgd: the rank of the gradient approximation (higher: closer, more bytes)
    sync_every: int = 50  # diloco: inner steps each replica trains alone between two meetings
    outer_lr: float = 0.7  # diloco: the outer Nesterov SGD's learning rate (the paper's 0.7; a run with few meetings: 1.0, docs/lan.md)
    outer_momentum: float = 0.9  # diloco: its momentum (the paper's 0.9; few meetings on real text: 0, docs/lan.md)
    diloco_replicas: int = 0  # diloco: replicas training apart; 0 = one per node (a node's GPUs train one with DDP)
    diloco_wire: str = "bf16"  # diloco: the deltas on the wire: bf16 | fp32 | int8 (a scale per 4096 values; for 2-3 replicas)
    diloco_overlap: int = 0  # diloco: steps a meeting crosses the link in the background (in as many portions); 0 = replicas wait
    timeout_s: int = 600  # collective (all_reduce, barrier) timeout
    init_timeout_s: int = 120  # process-group initialisation timeout


@dataclass
class HealthConfig:
    """Resource monitor and GPU circuit breaker, run in a background thread on one rank per node."""

    monitor_interval_s: float = 0.0  # > 0: sample CPU/RAM/disk/net/GPUs to RUN_DIR/resources/node<N>.jsonl and TensorBoard
    breaker: bool = True  # GPU circuit breaker (acts only where NVML sees GPUs, or with nvml_replay)
    breaker_interval_s: float = 5.0  # seconds between two NVML readings of the breaker (its own cadence, whatever the monitor's)
    temp_margin_c: float = 3.0  # open when a GPU is this close to its slowdown temperature
    # Not sw_thermal by default: NVML's normal clock control of a GPU at its temperature target (temp_margin_c judges heat).
    throttle_reasons: str = "hw_slowdown,hw_thermal,hw_power_brake"  # NVML throttle reasons that open the breaker when sustained
    throttle_samples: int = 3  # consecutive throttled samples (or ones within temp_margin_c of the threshold) before opening
    webhook_url: str = ""  # a secret: stored redacted, never logged (prefer webhook_url_env or webhook_url_file)
    webhook_url_env: str = ""  # the name of an environment variable holding the URL (read where the trainer runs)
    webhook_url_file: str = ""  # a file holding the URL (chmod 600; on a shared filesystem for Slurm jobs)
    webhook_type: str = "generic"  # generic JSON | discord | slack
    webhook_timeout_s: float = 5.0  # seconds before a webhook call gives up
    webhook_retries: int = 2  # retries of a failed webhook call
    nvml_replay: str = ""  # recorded readings (JSON lines) replayed instead of NVML: tests, incident replays
    hang_watch: bool = True  # a watchdog outside the loop names a hung rank, keeps stacks in RUN_DIR/hangs/, restarts or requeues the run
    hang_step_floor_s: float = 30.0  # no step on any rank of a node for this long is a hang (or 5x the longest step seen, if more)
    hang_section_floor_s: float = 300.0  # the same for an evaluation, a checkpoint, a DiLoCo meeting or a data window
    hang_startup_s: float = 1200.0  # from a worker's start to its first step (group, build, compile), capped under dist.timeout_s
    hang_restarts: int = 2  # restarts from the newest checkpoint after hangs that made no progress; then exit 77
    hang_exclude_node: bool = True  # Slurm: the requeued job leaves out the node whose rank hung (where the partition has spares)
    straggler_action: str = "warn"  # warn | exclude (Slurm: the next requeue leaves out the node of a rank named a straggler)
    screen: str = "skip"  # before: time every GPU's matmuls and the all-reduces before training (ops/screen.py); only: then stop
    screen_gemm_tflops: float = 0.0  # the matmul TFLOP/s a GPU should reach (0: judged against the other GPUs only)
    screen_allreduce_gbps: float = 0.0  # all-reduce bus bandwidth within a node, GB/s (0: against the other nodes only)
    screen_inter_gbps: float = 0.0  # all-reduce bus bandwidth across the job's nodes, GB/s (0: not judged)
    screen_min_fraction: float = 0.8  # a figure under this share of the expected one names its node
    screen_peer_fraction: float = 0.75  # a figure under this share of its peers' median names its node


@dataclass
class SlurmConfig:
    """What `submit` asks Slurm for. Precedence: CLI flags > this section > cluster profile > these defaults."""

    cluster: str = "generic"  # a profile in sbatch_templates/ (name or path)
    nodes: int = 1  # nodes of the job (--nodes)
    min_nodes: int = 0  # > 0: the job may start on min_nodes..nodes nodes (--nodes MIN:MAX): spares to leave a bad node out
    gpus_per_node: int = 0  # 0: a CPU job (gloo); one task per GPU otherwise
    gpu_type: str = ""  # a GPU type of the cluster's gres, e.g. h100: --gpus-per-node=h100:8 ("": any GPU)
    cpus_per_task: int = 0  # 0: Slurm's default
    mem: str = ""  # per node, e.g. 64G; "0" = all of it; "": Slurm's default
    time: str = "01:00:00"  # minutes, HH:MM:SS or D-HH:MM:SS
    partition: str = ""  # Slurm partition ("": the cluster's default)
    account: str = ""  # Slurm account to charge
    qos: str = ""  # Slurm quality of service
    constraint: str = ""  # Slurm node features (--constraint)
    exclude: str = ""  # nodes the job never runs on (--exclude), e.g. gpu[07-08] (a requeue adds the ones it leaves out)
    exclusive: bool = False  # whole nodes only (--exclusive)
    job_name: str = ""  # "": aura-<run_name>
    signal: str = "USR2"  # sent signal_lead_s before the time limit: checkpoint, then requeue
    signal_lead_s: int = 120  # seconds before the time limit that slurm.signal is sent
    max_requeues: int = 10  # automatic requeues after the pre-timeout signal, then stop
    array_parallelism: int = 0  # sweeps: array elements running at once; 0 = all
    nccl_debug: bool = False  # NCCL_DEBUG=INFO with INIT,NET subsystems, one file per host and pid
    container: str = "none"  # none | pyxis (srun --container-image, Pyxis/Enroot) | apptainer (apptainer exec wrapper)
    container_image: str = ""  # pyxis: nvcr.io#nvidia/pytorch:24.05-py3 or a .sqsh file; apptainer: a .sif file or docker:// URI
    container_mounts: str = ""  # /host:/container[:ro],...: output_dir and data.path must be mounted at their own paths
    container_workdir: str = ""  # working directory inside the container ("": output_dir for pyxis, apptainer's default)
    container_python: str = "python3"  # the image's Python, which has aura_hpc installed


@dataclass
class PsConfig:
    """Asynchronous parameter-server training over a LAN (`ps` on the server PC, `worker` on the others)."""

    port: int = 30005  # the server's TCP port (join and control); gloo adds ephemeral ports per worker
    workers: int = 2  # worker PCs the training data is split for: worker K reads shard K of this many
    max_staleness: int = 4  # a gradient computed on weights more than this many versions old is dropped
    staleness_weight: str = "inverse"  # inverse: a gradient s versions old steps at 1/(1+s) of the lr | none: full step
    wire_dtype: str = "bf16"  # gradients and weights on the network: bf16 | fp16 | fp32 (the server keeps fp32)
    push_every: int = 1  # a worker takes this many local steps (plain SGD between them) and pushes their mean gradient
    join_timeout_s: int = 60  # a worker gives up when no server answers within this
    worker_timeout_s: int = 120  # the server declares a silent worker gone after this (a Wi-Fi drop)


TRACKERS = ("tensorboard", "trackio", "wandb", "mlflow")


@dataclass
class TrackingConfig:
    """Experiment trackers rank 0 logs the metrics rows to, offline first (docs/tracking.md); metrics.jsonl is always written."""

    backends: str = "tensorboard"  # comma list of tensorboard, trackio, wandb, mlflow (the last three: pip install 'aura_hpc[tracking]')
    project: str = "aura_hpc"  # the trackio and W&B project, the MLflow experiment
    wandb_mode: str = "offline"  # offline: RUN_DIR/wandb/offline-run-*, `wandb sync` later | online: needs `wandb login` and the network
    mlflow_uri: str = ""  # "": a SQLite store in RUN_DIR/tracking/mlflow.db | an MLflow server's http(s):// URL
    sqlite_local: str = "auto"  # SQLite stores on node-local disk, copied into RUN_DIR/tracking/ (auto: RUN_DIR on NFS, Lustre...)
    copy_every_s: float = 60.0  # how often node-local SQLite stores are copied into the run directory (and at the end)
    queue_rows: int = 1000  # rows waiting for a slow tracker before rows are dropped (with one warning): a tracker never slows a step
    finish_wait_s: float = 30.0  # how long the end of a run (after its last checkpoint) waits for the trackers to finish


@dataclass
class RunConfig:
    run_name: str = "tiny"  # the run directory's name under output_dir (re-using it resumes)
    output_dir: str = "runs"  # where run directories go (shared by every node for Slurm; a relative one starts where submit runs)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    ps: PsConfig = field(default_factory=PsConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_name

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """The config as stored in a run directory and its checkpoints: secrets redacted."""
        d = self.to_dict()
        h = d["health"]
        if is_literal_url(h["webhook_url"]):
            # The launcher hands the URL to the workers in WEBHOOK_SECRET_ENV instead.
            h["webhook_url"] = redacted_url(h["webhook_url"])
            h["webhook_url_env"] = h["webhook_url_env"] or WEBHOOK_SECRET_ENV
        return yaml.safe_dump(d, sort_keys=False, allow_unicode=True)

    def model_fingerprint(self) -> str:
        """What must match between a checkpoint and the config resuming from it."""
        m = dataclasses.asdict(self.model)
        m.pop("preset")
        m.pop("dropout")
        key = {"model": m, "seq_len": self.data.seq_len}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


CHOICES: dict[str, tuple[str, ...]] = {
    "tracking.wandb_mode": ("offline", "online"),
    "tracking.sqlite_local": ("auto", "true", "false"),
    "train.schedule": ("cosine", "linear", "constant"),
    "train.optimizer": ("adamw", "sgd"),
    "train.precision": ("auto", "fp32", "bf16", "fp16", "fp64"),
    "train.compile": ("auto", "true", "false"),
    "train.loss": ("auto", "chunked", "full"),
    "train.fused_optimizer": ("auto", "true", "false"),
    "dist.backend": ("auto", "nccl", "gloo"),
    "dist.strategy": ("ddp", "fsdp", "zero1", "zero2", "zero3", "diloco"),
    "dist.compress": ("none", "bf16", "powersgd"),
    "dist.diloco_wire": ("bf16", "fp32", "int8"),
    "slurm.signal": ("USR2", "USR1", "INT", "HUP"),  # not TERM: scancel sends it, and a cancel would requeue
    "slurm.container": ("none", "pyxis", "apptainer"),
    "health.webhook_type": ("generic", "discord", "slack"),
    "health.straggler_action": ("warn", "exclude"),
    "health.screen": ("skip", "before", "only"),
    "ps.staleness_weight": ("inverse", "none"),
    "ps.wire_dtype": ("bf16", "fp16", "fp32"),
}

SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "dist": DistConfig,
    "slurm": SlurmConfig,
    "health": HealthConfig,
    "ps": PsConfig,
    "tracking": TrackingConfig,
}
TOP_LEVEL = ("run_name", "output_dir")
