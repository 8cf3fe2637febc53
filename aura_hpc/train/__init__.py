"""The worker side: what runs in every training process, whoever launched it.

Entry point `python -m aura_hpc.train RUN_DIR/config.yaml` (worker.py; `generate` samples a run
from generate.py). The rooms: loop/ (the training loop), checkpoint/ (what is saved and how),
parts/ (what a run is made of), strategies/ (DDP, FSDP, ZeRO, DiLoCo), model/ (our GPT-2),
process/ (what a worker process runs on), instruments/ (fault injection and probes). Nothing here
imports the launchers or the command line; they start this.
"""
