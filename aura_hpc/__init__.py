"""aura_hpc: one GPT-2 trainer from two laptops on a home network to a Slurm cluster."""

__version__ = "0.1.0"
