"""Where is my data: which batch reads which sample, and skipping a bad stretch, exactly accounted.

``where`` answers, for a map-style data state (``ResumableSampler``, ``ResumableDataLoader``), the
sample indices of any batch and the batch of any sample, at the cost of one position each (the
epoch's order is a keyed permutation and its inverse). ``skip`` moves a checkpoint's data position
past a bad stretch and records the skipped range in the state, publishing a new checkpoint and
leaving the old one as it was. Both are also commands: ``python -m resumable_data where`` and
``python -m resumable_data skip``. ``where_stream`` and ``skip_stream_state`` do the same for a
``StreamLoader`` state, given the pipeline (code, which the checkpoint does not hold): the shard and
record of any batch, and a skip of whole batches.
"""

from .skip import ends_a_skip, skip, skip_state, skip_stream_state
from .stream import StreamBatch, StreamWhereReport, where_stream
from .where import BatchReport, SampleReport, WhereReport, locate, where

__all__ = [
    "BatchReport",
    "SampleReport",
    "StreamBatch",
    "StreamWhereReport",
    "WhereReport",
    "ends_a_skip",
    "locate",
    "skip",
    "skip_state",
    "skip_stream_state",
    "where",
    "where_stream",
]
