"""Cluster tooling: `check` (one machine, or the network and storage between machines), resource
sampling and `monitor`, the GPU circuit breaker's readings and rules, and the fault webhook."""
