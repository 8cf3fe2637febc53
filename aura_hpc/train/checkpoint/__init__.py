"""What a checkpoint is and how it is written: the files, what is saved, the background writers, consolidation, DiLoCo's per-rank files."""
