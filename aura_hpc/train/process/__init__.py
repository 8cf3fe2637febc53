"""What a worker process runs on: the distributed environment, joining the process group, device and precision, signals, logging."""
