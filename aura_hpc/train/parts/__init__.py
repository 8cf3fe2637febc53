"""What a run is made of, built from its config: data, model, optimizer and its schedule, the batch layout
and the position checkpoints carry."""
