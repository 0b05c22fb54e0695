"""Deprecated: :class:`GracefulStop` lives in :mod:`resumable_data.checkpoint` (module
``resumable_data.checkpoint.signals``); this module goes in the next release."""

import warnings

from .checkpoint.signals import GracefulStop

__all__ = ["GracefulStop"]

warnings.warn(
    "resumable_data.signals moved to resumable_data.checkpoint.signals and the old module goes in the next "
    "release; use `from resumable_data.checkpoint import GracefulStop`",
    DeprecationWarning,
    stacklevel=2,
)
