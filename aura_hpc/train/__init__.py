"""The worker side: what runs in every training process, whoever launched it.

Entry point `python -m aura_hpc.train RUN_DIR/config.yaml` (worker.py). Nothing here imports the
launchers or the command line; they start this.
"""
