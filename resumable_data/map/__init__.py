"""Map-style loading: the resumable sampler, the loader built on it, and ``wrap``."""

from .dataloader import ResumableDataLoader
from .sampler import ResumableSampler
from .wrapping import wrap

__all__ = ["ResumableDataLoader", "ResumableSampler", "wrap"]
