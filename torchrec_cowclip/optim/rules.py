"""The registry of optimizers of the CowClip update (step 5 of ``docs/algorithm.md``).

An :class:`UpdateRule` names an optimizer's row step, the state it keeps per row, the
optimizer class TorchRec's planner sizes that state by, and the names TorchRec and FBGEMM
give it and its state. The built-in rules (Adam, the paper's; row-wise Adagrad; SGD; and
per-element Adagrad and AdamW, which TorchRec users set) are built here, at
import, from the functional core's row steps (:func:`~.functional.adam_step`, ...): this
module imports the core, never the reverse, so the registry is complete whatever imports
it first. A new optimizer is one more :func:`register_update_rule`. :data:`OPTIMIZERS`,
:data:`STATE_LAYOUT` and ``distributed.sharder.PLANNER_OPTIMIZER_CLASS`` are live views.

Example::

    >>> tuple(OPTIMIZERS), STATE_LAYOUT["rowwise_adagrad"]
    (('adam', 'rowwise_adagrad', 'sgd', 'adagrad', 'adamw'), (('sum', '1'),))
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterator, Mapping, Sequence, Tuple, Union, overload

from torchrec_cowclip.optim.functional import (
    OptimizerStep,
    adagrad_step,
    adam_step,
    adamw_step,
    rowwise_adagrad_step,
    sgd_step,
)

__all__ = [
    "BUILT_IN_RULES",
    "OPTIMIZERS",
    "STATE_LAYOUT",
    "UPDATE_RULES",
    "OptimizerStep",
    "RuleView",
    "UpdateRule",
    "register_update_rule",
    "unregister_update_rule",
    "update_rule",
]


@dataclass(frozen=True)
class UpdateRule:
    """One optimizer of step 5, as the registry holds it.

    Attributes:
        name: the ``optimizer=`` value that selects it.
        step: its :data:`OptimizerStep`.
        state_layout: the state tensors it keeps, ``(name, "D")`` for one value per
            column (like the weight) or ``(name, "1")`` for one per row.
        planner_optimizer: import path of the torch/TorchRec optimizer class whose state
            size TorchRec's planner knows to be the same (``"torch.optim.Adam"``).
        adam_bias_corrections: ``step`` receives Adam's bias corrections
            (:func:`~.functional.adam_bias_corrections`) as ``adam_bias``, which the fused update
            computes once per table rather than once per row.
        torchrec_optimizers: how TorchRec names this optimizer: FBGEMM's ``EmbOptimType``
            values (``fused_params["optimizer"]``) and the qualified names of the
            torch/TorchRec optimizer classes ``apply_optimizer_in_backward`` may be given.
        fbgemm_states: ``(state name here, FBGEMM's)`` for each state tensor FBGEMM keeps
            with the same meaning (TorchRec keys it ``<table>.<FBGEMM's name>``).
        decoupled_weight_decay: ``step`` applies ``weight_decay`` to the weight itself
            (AdamW); the core then adds no coupled L2 to the gradient.
    """

    name: str
    step: OptimizerStep
    state_layout: Tuple[Tuple[str, str], ...]
    planner_optimizer: str
    adam_bias_corrections: bool = False
    torchrec_optimizers: Tuple[str, ...] = ()
    fbgemm_states: Tuple[Tuple[str, str], ...] = ()
    decoupled_weight_decay: bool = False

    def __post_init__(self) -> None:
        bad = [entry for entry in self.state_layout if entry[1] not in ("D", "1")]
        if bad:
            raise ValueError(
                f"update rule {self.name!r}: state layout entries must be (name, 'D' or '1'), got {bad}"
            )


#: The built-in rules, with the names TorchRec and FBGEMM give them. FBGEMM's first state
#: is "momentum1" whatever its optimizer; TorchRec names the others after FBGEMM's
#: ``get_optimizer_state()`` ("exp_avg_sq").
_ADAM = UpdateRule(
    "adam",
    adam_step,
    (("exp_avg", "D"), ("exp_avg_sq", "D")),
    "torch.optim.Adam",
    adam_bias_corrections=True,
    torchrec_optimizers=("adam", "torch.optim.adam.Adam", "torchrec.optim.optimizers.Adam"),
    fbgemm_states=(("exp_avg", "momentum1"), ("exp_avg_sq", "exp_avg_sq")),
)
BUILT_IN_RULES: Tuple[UpdateRule, ...] = (
    _ADAM,
    UpdateRule(
        "rowwise_adagrad",
        rowwise_adagrad_step,
        (("sum", "1"),),
        "torchrec.optim.RowWiseAdagrad",
        # FBGEMM's ROWWISE_ADAGRAD is the same update, applied without the sort that
        # makes EXACT_ROWWISE_ADAGRAD deterministic; this one is always exact.
        torchrec_optimizers=(
            "exact_row_wise_adagrad",
            "row_wise_adagrad",
            "torchrec.optim.rowwise_adagrad.RowWiseAdagrad",
        ),
        fbgemm_states=(("sum", "momentum1"),),
    ),
    UpdateRule(
        "sgd",
        sgd_step,
        (),
        "torch.optim.SGD",
        torchrec_optimizers=(
            "exact_sgd",
            "sgd",
            "torch.optim.sgd.SGD",
            "torchrec.optim.optimizers.SGD",
        ),
    ),
    UpdateRule(
        "adagrad",
        adagrad_step,
        (("sum", "D"),),
        "torch.optim.Adagrad",
        # torch.optim.Adagrad's update with lr_decay=0 and a zero initial accumulator (its
        # other keywords are refused by name).
        torchrec_optimizers=("exact_adagrad", "adagrad", "torch.optim.adagrad.Adagrad"),
        fbgemm_states=(("sum", "momentum1"),),
    ),
    # Adam's state (its layout, FBGEMM's names of it, the bias corrections) with the
    # decay taken off the weight. FBGEMM has no AdamW type: it is EmbOptimType.ADAM with
    # WeightDecayMode.DECOUPLE (torchrec_config reads that pair as this rule).
    replace(
        _ADAM,
        name="adamw",
        step=adamw_step,
        planner_optimizer="torch.optim.AdamW",
        torchrec_optimizers=("torch.optim.adamw.AdamW",),
        decoupled_weight_decay=True,
    ),
)

#: The registered optimizers, by name, in registration order: the built-in ones first.
UPDATE_RULES: Dict[str, UpdateRule] = {rule.name: rule for rule in BUILT_IN_RULES}


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
