"""The training loop: the trainer, one step, batches, evaluation, metrics, the data a rank keeps local, how a run ends."""
