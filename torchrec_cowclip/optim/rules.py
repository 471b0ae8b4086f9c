"""The registry of optimizers of the CowClip update (step 5 of ``docs/algorithm.md``).

An :class:`UpdateRule` names an optimizer's row step, the state it keeps per row, the
optimizer class TorchRec's planner sizes that state by, and the names TorchRec and FBGEMM
give it and its state. The built-in rules (Adam, row-wise Adagrad, SGD) are registered by
the functional core (:mod:`torchrec_cowclip.optim.functional`), with the math they run;
a new optimizer is one more :func:`register_update_rule`. :data:`OPTIMIZERS`,
:data:`STATE_LAYOUT` and ``distributed.options.PLANNER_OPTIMIZER_CLASS`` are live views.

Example::

    >>> import torchrec_cowclip.optim.functional  # registers the built-in rules
    >>> tuple(OPTIMIZERS), STATE_LAYOUT["rowwise_adagrad"]
    (('adam', 'rowwise_adagrad', 'sgd'), (('sum', '1'),))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Mapping, Sequence, Tuple, Union, overload

__all__ = [
    "OPTIMIZERS",
    "STATE_LAYOUT",
    "UPDATE_RULES",
    "RowRule",
    "RuleView",
    "UpdateRule",
    "register_update_rule",
    "unregister_update_rule",
    "update_rule",
]


#: A row step: ``rule(weight, grad, state, *, lr, step, betas, eps, weight_decay, scale,
#: row_sums, adam_bias)`` updates ``weight`` and ``state`` in place from the clipped,
#: decayed ``grad`` (the keywords are :func:`cowclip_row_update_`'s; ``scale`` is the
#: clip factor of step 3). A rule takes the keywords it needs and ``**_`` for the rest.
RowRule = Callable[..., None]


@dataclass(frozen=True)
class UpdateRule:
    """One optimizer of step 5, as the registry holds it.

    Attributes:
        name: the ``optimizer=`` value that selects it.
        step: its :data:`RowRule`.
        state_layout: the state tensors it keeps, ``(name, "D")`` for one value per
            column (like the weight) or ``(name, "1")`` for one per row.
        planner_optimizer: import path of the torch/TorchRec optimizer class whose state
            size TorchRec's planner knows to be the same (``"torch.optim.Adam"``).
        adam_bias_corrections: ``step`` receives Adam's bias corrections
            (:func:`adam_bias_corrections`) as ``adam_bias``, which the fused update
            computes once per table rather than once per row.
        torchrec_optimizers: how TorchRec names this optimizer: FBGEMM's ``EmbOptimType``
            values (``fused_params["optimizer"]``) and the qualified names of the
            torch/TorchRec optimizer classes ``apply_optimizer_in_backward`` may be given.
        fbgemm_states: ``(state name here, FBGEMM's)`` for each state tensor FBGEMM keeps
            with the same meaning (TorchRec keys it ``<table>.<FBGEMM's name>``).
    """

    name: str
    step: RowRule
    state_layout: Tuple[Tuple[str, str], ...]
    planner_optimizer: str
    adam_bias_corrections: bool = False
    torchrec_optimizers: Tuple[str, ...] = ()
    fbgemm_states: Tuple[Tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        bad = [entry for entry in self.state_layout if entry[1] not in ("D", "1")]
        if bad:
            raise ValueError(
                f"update rule {self.name!r}: state layout entries must be (name, 'D' or '1'), got {bad}"
            )


#: The registered optimizers, by name, in registration order.
UPDATE_RULES: Dict[str, UpdateRule] = {}


def register_update_rule(rule: UpdateRule) -> UpdateRule:
    """Adds ``rule`` to :data:`UPDATE_RULES` (and so to every view of it); a name that is
    taken raises ValueError."""
    if rule.name in UPDATE_RULES:
        raise ValueError(f"an update rule named {rule.name!r} is already registered")
    UPDATE_RULES[rule.name] = rule
    return rule


def unregister_update_rule(name: str) -> None:
    """Removes the rule ``name`` (tests that register their own)."""
    if name not in UPDATE_RULES:
        raise KeyError(f"no update rule named {name!r}; registered: {tuple(UPDATE_RULES)}")
    del UPDATE_RULES[name]


def update_rule(name: str) -> UpdateRule:
    """The rule ``name``, or ValueError listing the registered ones."""
    rule = UPDATE_RULES.get(name)
    if rule is None:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {tuple(UPDATE_RULES)}")
    return rule


class _Names(Sequence[str]):
    """The registered optimizer names, live (a tuple's equality and repr; unhashable,
    since it changes with the registry)."""

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> Tuple[str, ...]: ...

    def __getitem__(self, index: Union[int, slice]) -> Union[str, Tuple[str, ...]]:
        return tuple(UPDATE_RULES)[index]

    def __len__(self) -> int:
        return len(UPDATE_RULES)

    def __contains__(self, name: object) -> bool:
        return name in UPDATE_RULES

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (tuple, _Names)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(tuple(UPDATE_RULES))


class RuleView(Mapping[str, Any]):
    """One attribute of every registered rule, by name, live: a read-only mapping."""

    def __init__(self, read: Callable[[UpdateRule], Any]) -> None:
        self._read = read

    def __getitem__(self, name: str) -> Any:
        rule = UPDATE_RULES.get(name)
        if rule is None:
            raise KeyError(name)
        return self._read(rule)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(UPDATE_RULES))

    def __len__(self) -> int:
        return len(UPDATE_RULES)

    def __repr__(self) -> str:
        return repr(dict(self))


#: The registered optimizer names (a live view of :data:`UPDATE_RULES`).
OPTIMIZERS: Sequence[str] = _Names()

#: Optimizer state tensors per optimizer; each entry is (name, per-row shape suffix)
#: where "D" means one value per column and "1" one value per row (a live view).
STATE_LAYOUT: Mapping[str, Tuple[Tuple[str, str], ...]] = RuleView(lambda rule: rule.state_layout)
