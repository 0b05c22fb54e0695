"""Helpers the tests share, written once: the trainer's tiny run and what its tests read back.

Comparisons are the library's own (:func:`resumable_data.testing.assert_same`); the trainer's
system checks (verify-resume, chaos, kill points) are in ``tests/system/``.
"""
