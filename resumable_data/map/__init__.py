"""Map-style loading: the resumable sampler, the loader built on it, and ``wrap``."""

from .dataloader import ResumableDataLoader, wrap
from .sampler import ResumableSampler

__all__ = ["ResumableDataLoader", "ResumableSampler", "wrap"]
