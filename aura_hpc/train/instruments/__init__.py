"""Fault injection and the GPU-contract probes: inert unless their environment variables are set."""
