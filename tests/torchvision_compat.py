"""Import torchvision where PyPI's CUDA build of it sits on torch's CPU wheel (our CI machines).

PyPI's Linux torchvision wheels are CUDA builds: against torch's ``+cpu`` wheel their C++ ops
cannot load (they link ``libtorch_cuda.so``), and torchvision 0.28's import then stops at an
unguarded fake-kernel registration: ``RuntimeError: operator torchvision::nms does not exist``
(pytorch/pytorch#122494; the fix for users is torchvision from the same index as their torch).
The v2 transforms the tests use are pure PyTorch and never call those ops, so the tests declare
the two op schemas the import needs (never implemented, never called) and import again.
Where torchvision loads normally, this does nothing.
"""

from __future__ import annotations

import sys
from types import ModuleType

_UNGUARDED_OPS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library = None  # kept alive: the schemas live as long as the Library object


def load_torchvision() -> ModuleType:
    """``import torchvision``, declaring the missing op schemas if its C++ ops cannot load.

    Raises:
        ImportError: torchvision is not installed.
    """
    global _library
    try:
        import torchvision
    except RuntimeError as exc:
        if "torchvision::nms" not in str(exc):
            raise
        import torch

        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        _library = torch.library.Library("torchvision", "DEF")
        for schema in _UNGUARDED_OPS:
            _library.define(schema)
        import torchvision
    return torchvision


def pytest_torchvision() -> ModuleType:
    """:func:`load_torchvision` for a test module: skipped visibly when torchvision is missing."""
    import pytest

    try:
        return load_torchvision()
    except ImportError as exc:
        pytest.skip(f"the [vision] extra (torchvision) is not installed: {exc}", allow_module_level=True)
