"""Building blocks with no loader, no I/O and no ``torch.utils.data``: state keys and their checks,
hashing, the keyed permutation, the epoch cursor, the rank/world lookup."""

from .permutation import Permutation

__all__ = ["Permutation"]
