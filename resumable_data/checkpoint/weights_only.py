"""What ``torch.load(weights_only=True)`` can load: the check before a save, the copy for an async
save, and the load itself with its many failure types turned into one ``ResumeError`` line.

A checkpoint must never need full unpickling to be read back (a pickle can run any code), so a state
is checked *before* anything is written: only tensors, ints, floats, bools, strings and None, in
dicts, OrderedDicts, lists and tuples.
"""

from __future__ import annotations

import collections
import os
import re
import warnings
from typing import Any

import torch

from ..errors import ResumeError

__all__ = ["load_weights_only", "snapshot"]

# Exactly the types torch.load(weights_only=True) reconstructs without extra allow-listing.
# OrderedDict is there because nn.Module.state_dict() returns one.
_LEAF_TYPES = (int, float, bool, str, type(None))
_MAPPING_TYPES = (dict, collections.OrderedDict)
_SEQUENCE_TYPES = (list, tuple)
# torch's weights_only refusal wraps the one informative line in advice about weights_only=False,
# which a checkpoint tool must never give.
_BOILERPLATE = re.compile(
    r"^(Weights only load failed|In PyTorch 2\.6|Re-running `torch\.load`|Please file an issue|Check the "
    r"documentation|WeightsUnpickler error:\s*$)"
)
_MAX_REASON = 300


def is_mapping(obj: Any) -> bool:
    """Whether ``obj`` is a dict type that weights_only loading reconstructs."""
    return type(obj) in _MAPPING_TYPES


def snapshot(obj: Any, where: str, *, copy: bool, memo: dict[Any, Any]) -> Any:
    """Check ``obj`` loads with weights_only; with ``copy``, deep-copy it with tensors on CPU.

    ``memo`` keeps one copy per tensor object and per storage (see :func:`copy_tensor`), so
    tensors that share storage (tied weights, views) share it in the copy too, as torch.save
    keeps it: the copy saves to the same bytes as the original.
    """
    if isinstance(obj, torch.Tensor):
        if not copy:
            return obj
        if ("tensor", id(obj)) not in memo:
            memo[("tensor", id(obj))] = copy_tensor(obj, memo)
        return memo[("tensor", id(obj))]
    if type(obj) in _LEAF_TYPES:
        return obj
    if type(obj) in _MAPPING_TYPES:
        items = []
        for key, value in obj.items():
            if type(key) not in _LEAF_TYPES:
                raise ResumeError(
                    f"{where} has a key of type {type(key).__name__} ({key!r}); checkpoint keys "
                    f"must be str, int, float, bool or None to load with weights_only=True"
                )
            items.append((key, snapshot(value, f"{where}[{key!r}]", copy=copy, memo=memo)))
        if not copy:
            return obj
        result = type(obj)(items)
        # nn.Module.state_dict() attaches per-module versions as the dict's ``_metadata`` and
        # load_state_dict reads them back: the documented convention (see nn.Module._version),
        # the one underscore attribute this library touches on another object, kept on purpose.
        if hasattr(obj, "_metadata"):
            result._metadata = obj._metadata
        return result
    if type(obj) in _SEQUENCE_TYPES:
        values = [snapshot(v, f"{where}[{i}]", copy=copy, memo=memo) for i, v in enumerate(obj)]
        return type(obj)(values) if copy else obj
    raise ResumeError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which "
        f"torch.load(weights_only=True) cannot load; store plain data instead (tensors, int, "
        f"float, bool, str, None in dicts/lists/tuples), e.g. call .state_dict() on it, "
        f"torch.from_numpy() an array or .item() a numpy scalar. Nothing was written."
    )


def copy_tensor(tensor: torch.Tensor, memo: dict[Any, Any]) -> torch.Tensor:
    """A detached CPU copy of ``tensor`` that shares a storage copy with the other tensors copied
    through ``memo`` that share its storage.

    Each source storage is copied once, whole, and the tensor rebuilt as a view on the copy with
    the same dtype, offset, size and stride. Copying tensor by tensor would untie tied weights
    (``wte.weight`` and ``lm_head.weight`` are two tensors on one storage): the async checkpoint
    would hold them twice, be larger than the sync one, and load untied. The key is the storage
    storage's public identity (device, data pointer and size; the storage is kept alive in
    ``memo``, so no other storage can take its address meanwhile) plus the dtype: torch.save
    refuses one storage viewed as two dtypes, so each dtype gets its own copy, which saves as before.
    """
    tensor = tensor.detach()
    if (
        type(tensor) is not torch.Tensor
        or tensor.layout != torch.strided
        or tensor.is_quantized
        or tensor.is_conj()
        or tensor.is_neg()
        or tensor.device.type == "meta"
    ):
        # No plain storage to share (sparse, quantized, subclasses) or lazy bits that set_()
        # would drop: copy the tensor alone.
        return tensor.to("cpu", copy=True)
    source = tensor.untyped_storage()
    key = ("storage", str(source.device), source.data_ptr(), source.nbytes(), tensor.dtype)
    if key not in memo:
        copied = source.clone() if source.device.type == "cpu" else source.cpu()
        # Keep the source alive with its copy, so its address cannot be reused by another storage.
        memo[key] = (source, copied)
    copied = memo[key][1]
    return torch.empty(0, dtype=tensor.dtype).set_(copied, tensor.storage_offset(), tensor.size(), tensor.stride())


def load_weights_only(path: str | os.PathLike[str], *, map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)``, failing only with a one-line ``ResumeError``.

    torch raises a dozen types for a damaged file (RuntimeError from the zip reader, UnpicklingError,
    EOFError, KeyError, IndexError, UnicodeDecodeError...) and a multi-paragraph message for a refused
    global; all of them mean "this payload cannot be loaded safely", so all become one line that names
    the file. Nothing in the file is executed: a global outside torch's allow-list is refused before
    it is called. torch's warnings about unusual pickle protocols are silenced (the error says enough).

    Raises:
        ResumeError: the file cannot be read or is not a weights-only payload.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location=map_location, weights_only=True)
    except OSError as e:
        raise ResumeError(f"cannot read checkpoint {path}: {e.strerror or e}") from e
    except Exception as e:
        raise ResumeError(f"cannot load checkpoint {path}: {_reason(e)}") from e


def _reason(error: BaseException) -> str:
    """One short line saying why torch refused a payload."""
    lines = [line.strip() for line in str(error).splitlines()]
    informative = [line for line in lines if line and not _BOILERPLATE.match(line)]
    text = " ".join(informative) or type(error).__name__
    if "Weights only load failed" in str(error):
        text = f"refused by weights_only loading, nothing was executed: {text}"
    else:
        text = f"not a readable torch checkpoint ({type(error).__name__}: {text})"
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."
