"""A minimal GPT trainer built on resumable_data: kill it at any moment and it continues exactly.

``python -m trainer`` trains a small byte-level GPT on the Python standard library's source;
see ``python -m trainer --help`` and :func:`trainer.train.train`.
"""

from .model import GPT, ModelConfig
from .train import TrainConfig, TrainResult, train

__all__ = ["GPT", "ModelConfig", "TrainConfig", "TrainResult", "train"]
