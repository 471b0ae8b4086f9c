"""All-or-nothing loads: a state dict is checked against the live state before any of
it is copied in.

TorchRec's ``KeyedOptimizer.load_state_dict`` and ``nn.Module.load_state_dict`` copy
tensor after tensor and raise at the first (or after every) misfit, leaving what came
before it overwritten. :func:`check_loadable` walks the incoming state and the live one
side by side - by whatever keys they have, so it holds whatever the keys are named -
and raises :class:`StateDictMismatch` naming the first key whose presence, shape,
dtype, shards or finiteness differ; the loads of this package call it first, so a
refused load changes nothing.

Example::

    >>> import torch
    >>> live = {"w": {"exp_avg": torch.zeros(4, 2), "step": torch.tensor(3.0)}}
    >>> check_loadable({"w": {"exp_avg": torch.ones(4, 2), "step": torch.tensor(5.0)}}, live)
    >>> check_loadable({"w": {"exp_avg": torch.ones(5, 2), "step": torch.tensor(5.0)}}, live,
    ...                what="fused optimizer state")
    Traceback (most recent call last):
    ...
    torchrec_cowclip.optim.load_check.StateDictMismatch: fused optimizer state: ['w']['exp_avg'] is [5, 2] float32 in the state dict, [4, 2] float32 here; nothing was loaded
"""

from __future__ import annotations

from typing import Any, List, Mapping, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["StateDictMismatch", "check_loadable", "check_module_loadable"]


class StateDictMismatch(ValueError):
    """A state dict does not fit the state it would be loaded into (nothing was loaded)."""


def _local_pieces(value: Any) -> List[Tensor]:
    """The tensors of this process: a ``ShardedTensor``'s local shards, or the tensor."""
    if hasattr(value, "local_shards"):
        return [shard.tensor for shard in value.local_shards()]
    return [value]


def _describe(pieces: Sequence[Tensor], size: Tuple[int, ...]) -> str:
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in pieces}) or ["-"]
    shards = f" in local shards {[list(p.shape) for p in pieces]}" if len(pieces) != 1 else ""
    return f"{list(size)} {'/'.join(dtypes)}{shards}"


def _same_dtype(new: Tensor, old: Tensor, cast_floats: bool) -> bool:
    if cast_floats and new.is_floating_point() and old.is_floating_point():
        return True
    return new.dtype == old.dtype


def _check_tensor(
    incoming: Any, current: Any, where: str, what: str, cast_floats: bool = False
) -> None:
    def refuse(reason: str) -> StateDictMismatch:
        return StateDictMismatch(f"{what}: {where} {reason}; nothing was loaded")

    if not isinstance(incoming, Tensor):
        raise refuse(f"is a {type(incoming).__name__} in the state dict, a tensor here")
    new_pieces, old_pieces = _local_pieces(incoming), _local_pieces(current)
    new_size, old_size = tuple(incoming.size()), tuple(current.size())
    same = (
        new_size == old_size
        and len(new_pieces) == len(old_pieces)
        and all(
            n.shape == o.shape and _same_dtype(n, o, cast_floats)
            for n, o in zip(new_pieces, old_pieces)
        )
    )
    if not same:
        raise refuse(
            f"is {_describe(new_pieces, new_size)} in the state dict, "
            f"{_describe(old_pieces, old_size)} here"
        )
    for piece in new_pieces:
        if piece.is_floating_point() and piece.numel() and not bool(torch.isfinite(piece).all()):
            raise refuse("holds NaN or inf values")


def check_loadable(
    incoming: Any,
    current: Any,
    what: str = "state dict",
    where: str = "",
    cast_floats: bool = False,
) -> None:
    """Raises :class:`StateDictMismatch` unless ``incoming`` has the structure of
    ``current`` (the same keys of every mapping, lengths of every sequence) and each of
    its tensors the shape, dtype and local shards of the live one, all finite. Values
    that are not tensors in ``current`` (numbers, strings) are not compared.

    Args:
        incoming: the state dict to load.
        current: the live state it would be copied into (e.g. ``module.state_dict()``).
        what: how the message names the state.
        where: the key path so far (for the recursion).
        cast_floats: a floating tensor may come in another floating dtype (a module's
            weights: ``nn.Module.load_state_dict`` casts them, and TorchRec's unsharded
            EBC keeps BF16 tables as float16).
    """
    if isinstance(current, Tensor):
        _check_tensor(incoming, current, where or "<root>", what, cast_floats)
        return
    if isinstance(current, Mapping):
        if not isinstance(incoming, Mapping):
            raise StateDictMismatch(
                f"{what}: {where or '<root>'} is a {type(incoming).__name__} in the state "
                "dict, a mapping here; nothing was loaded"
            )
        missing = [k for k in current if k not in incoming]
        unexpected = [k for k in incoming if k not in current]
        if missing or unexpected:
            first = f"{where}[{(missing or unexpected)[0]!r}]"
            raise StateDictMismatch(
                f"{what}: {first} is {'missing from' if missing else 'not expected in'} the "
                f"state dict ({len(missing)} missing, {len(unexpected)} unexpected); "
                "nothing was loaded"
            )
        for key, value in current.items():
            check_loadable(incoming[key], value, what, f"{where}[{key!r}]", cast_floats)
        return
    if isinstance(current, (list, tuple)):
        if not isinstance(incoming, (list, tuple)) or len(incoming) != len(current):
            shown = len(incoming) if isinstance(incoming, (list, tuple)) else "no"
            raise StateDictMismatch(
                f"{what}: {where or '<root>'} has {shown} items in the state dict, "
                f"{len(current)} here; nothing was loaded"
            )
        for i, (new, old) in enumerate(zip(incoming, current)):
            check_loadable(new, old, what, f"{where}[{i}]", cast_floats)


def check_module_loadable(
    incoming: Mapping[str, Any], current: Mapping[str, Any], strict: bool, what: str
) -> None:
    """:func:`check_loadable` for ``nn.Module.load_state_dict(incoming, strict)`` of a
    module whose state dict is ``current``: its weights may come in another floating
    dtype (``nn.Module`` casts them); with ``strict=False`` only the keys present in both
    are compared."""
    if not strict:
        current = {k: v for k, v in current.items() if k in incoming}
        incoming = {k: v for k, v in incoming.items() if k in current}
    check_loadable(dict(incoming), current, what, cast_floats=True)
