"""The hand-written loop bench_gpu.py holds the trainer against: aura_hpc/ops/reference_loop.py
(a minimal GPT-2 written independently of the trainer's model, compiled, data already on the GPU),
also what `python -m aura_hpc selftest` measures against. Same arguments; prints one JSON line."""

from aura_hpc.ops.reference_loop import main

if __name__ == "__main__":
    main()
