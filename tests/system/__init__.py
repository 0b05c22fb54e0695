"""The trainer's system checks: test instrumentation, kept out of ``trainer/`` (its reading path).

``verify`` (killed + resumed == uninterrupted, bitwise), ``chaos`` and ``chaos_distributed``
(SIGKILLs mid-write and relaunches), ``killpoints`` (the trainer kills itself at a chosen moment;
``python -m system.killpoints`` with ``tests/`` on the path), ``index_log`` (every rank's batch
indices, for the elastic checks) and ``gpu_smoke`` (the CUDA checks). The tests import them;
``python tests/system verify-resume|chaos|gpu-smoke`` (or ``python -m trainer`` with the same
command) runs them from the checkout's root. The trainer never imports these.
"""
