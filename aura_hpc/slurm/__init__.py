"""Slurm: the submit plan (no side effects), submitit submission, what each task runs, cluster
profiles, and following jobs over squeue/sacct (status, logs, cancel, history)."""
