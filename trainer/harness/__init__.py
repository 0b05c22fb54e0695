"""Test instrumentation of the trainer, kept off its reading path.

``verify`` (killed + resumed == uninterrupted, bitwise), ``chaos`` (SIGKILLs mid-write and relaunches),
``killpoints`` (the process kills itself at a chosen moment; ``python -m trainer.harness.killpoints``),
``index_log`` (every rank's batch indices, for the elastic checks) and ``gpu_smoke`` (the CUDA checks).
The trainer never imports these; ``python -m trainer verify-resume|chaos|gpu-smoke`` runs them.
"""
