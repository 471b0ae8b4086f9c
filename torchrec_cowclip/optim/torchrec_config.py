"""TorchRec's ways of saying how fused tables train, read onto one ``CowClipOptions``.

A TorchRec user configures a fused embedding optimizer in two places, and this project
in a third; all of them land on the same :class:`~torchrec_cowclip.optim.options.CowClipOptions`:

* a sharder's ``fused_params`` - FBGEMM's keys: ``optimizer`` (an ``EmbOptimType``:
  ``ADAM``, ``EXACT_ROWWISE_ADAGRAD`` / ``ROWWISE_ADAGRAD``, ``EXACT_SGD`` / ``SGD``,
  ``EXACT_ADAGRAD``, or its string value), ``learning_rate``, ``eps``, ``beta1``, ``beta2``,
  ``weight_decay`` with ``weight_decay_mode=WeightDecayMode.L2`` (or ``DECOUPLE`` with
  ``ADAM``: AdamW), TorchRec's TBE keys ``stochastic_rounding`` and ``output_dtype`` - plus
  CowClip's own: ``cowclip`` (a
  :class:`~torchrec_cowclip.optim.options.CowClip`, or None for no clip),
  ``unclipped_tables``, ``count_lr``, ``helen`` (:func:`fused_params_settings`);
* ``apply_optimizer_in_backward(optimizer_class, [weight], kwargs)`` on each table's
  weight, with a torch/TorchRec class (``torch.optim.Adam``, ``torch.optim.AdamW``,
  ``torch.optim.Adagrad``, ``torchrec.optim.RowWiseAdagrad``, ``torch.optim.SGD``, ...) or one of :mod:`.in_backward`'s (``CowClipAdam``, ...), whose
  ``cowclip=None`` on some tables makes those the unclipped ones (:func:`in_backward_settings`;
  :func:`converted_options` reads them when a stock collection is converted,
  :class:`LateMarks` when they are made on a built one);
* ``CowClipOptions`` itself (``options=``), and a
  :class:`~torchrec_cowclip.CowClipEmbeddingBagCollection`'s own options (:func:`options_settings`).

What cannot be honoured is refused in one line naming the key: another optimizer (those of
:data:`REFUSED_OPTIMIZERS` with why), a key this update has no use for, decoupled weight
decay with another optimizer than Adam, a counter-based ``weight_decay_mode``, and
FBGEMM's ``WeightDecayMode.COWCLIP``, which is not the paper's algorithm (it clips
against the number of steps a row has appeared in, cumulative unless a half-life > 0
decays it, not the row's count in this batch, and scales the Adagrad step rather than the
gradient; it has no Adam).
:func:`resolve_options` merges the sources: a field two of them set must agree, or the
merge is refused naming both spellings. TorchRec's doors set what they do not say to
FBGEMM's defaults (``learning_rate`` 0.01, as TorchRec would train); those give way to a
value set explicitly elsewhere. A field no source sets keeps ``CowClipOptions``' default.

Example::

    >>> settings = fused_params_settings({"optimizer": "exact_row_wise_adagrad",
    ...                                   "learning_rate": 0.5, "cowclip": None})
    >>> options = resolve_options([settings])
    >>> options.optimizer, options.lr, options.eps, options.cowclip
    ('rowwise_adagrad', 0.5, 1e-08, None)
    >>> resolve_options([settings, options_settings(options.replace(lr=0.1), "options=")])
    Traceback (most recent call last):
    ...
    ValueError: fused_params['learning_rate']=0.5 and options= lr=0.1 disagree on the tables' lr: give it once
    >>> fused_params_settings({"optimizer": "adam", "weight_decay_mode": 4})
    Traceback (most recent call last):
    ...
    ValueError: fused_params['weight_decay_mode']=COWCLIP is refused: FBGEMM's WeightDecayMode.COWCLIP ...
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from torchrec_cowclip.compat import in_backward_mark_count, in_backward_optimizer
from torchrec_cowclip.optim.in_backward import CowClipInBackward
from torchrec_cowclip.optim.options import CowClip, CowClipOptions, checked_options
from torchrec_cowclip.optim.rules import UPDATE_RULES

__all__ = [
    "FBGEMM_DEFAULTS",
    "LateMarks",
    "REFUSED_OPTIMIZERS",
    "Setting",
    "converted_options",
    "fused_params_settings",
    "in_backward_settings",
    "marked_options",
    "options_settings",
    "resolve_options",
    "table_marks",
    "torchrec_rule",
]

#: The hyperparameters FBGEMM's training TBE takes when ``fused_params`` leave them out
#: (``SplitTableBatchedEmbeddingBagsCodegen``'s defaults in fbgemm-gpu 1.8).
FBGEMM_DEFAULTS: Mapping[str, Any] = {
    "lr": 0.01,
    "eps": 1.0e-8,
    "betas": (0.9, 0.999),
    "weight_decay": 0.0,
}

#: ``fused_params`` keys that are FBGEMM's hyperparameters of the optimizers here.
_FBGEMM_KEYS = (
    "optimizer",
    "learning_rate",
    "eps",
    "beta1",
    "beta2",
    "weight_decay",
    "weight_decay_mode",
)
#: ``fused_params`` keys of this project (no FBGEMM module sees them).
_OWN_KEYS = ("cowclip", "unclipped_tables", "count_lr", "helen")
#: ``fused_params`` keys of TorchRec's TBE that are not the optimizer's: how half tables
#: round (``stochastic_rounding``) and the pooled outputs' type (``output_dtype``, a
#: ``SparseType`` or its value).
_TBE_KEYS = ("stochastic_rounding", "output_dtype")
#: ``SparseType`` values an ``output_dtype`` may take, as torch types.
_OUTPUT_TYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

#: ``fbgemm_gpu``'s ``WeightDecayMode`` values (an IntEnum; named here so that reading a
#: config needs no fbgemm_gpu import).
_WEIGHT_DECAY_MODES = {
    0: "NONE",
    1: "L2",
    2: "DECOUPLE",
    3: "COUNTER",
    4: "COWCLIP",
    5: "DECOUPLE_GLOBAL",
}


@dataclass(frozen=True)
class Setting:
    """One ``CowClipOptions`` field as one source sets it.

    Attributes:
        value: the field's value.
        spelled: how the source wrote it (``fused_params['learning_rate']=0.5``), for errors.
        explicit: the source said it; False for a default the source implies (FBGEMM's),
            which gives way to an explicit value from another source.
    """

    value: Any
    spelled: str
    explicit: bool = True


#: A source's settings, by ``CowClipOptions`` field.
Settings = Dict[str, Setting]


def _name_of(value: Any) -> str:
    return str(value.value) if isinstance(value, enum.Enum) else str(value)


def torchrec_rule(name: Any) -> Optional[str]:
    """The update rule TorchRec's name ``name`` is (an ``EmbOptimType`` or its value, a
    rule's own name, or an optimizer class's qualified name), or None.

    Example::

        >>> torchrec_rule("exact_row_wise_adagrad"), torchrec_rule("torch.optim.adam.Adam")
        ('rowwise_adagrad', 'adam')
    """
    text = _name_of(name)
    for rule in UPDATE_RULES.values():
        if text == rule.name or text in rule.torchrec_optimizers:
            return rule.name
    return None


_TRUST_RATIO = (
    "its trust ratio rescales each row's step by ||W|| / ||step||, a second per-row norm "
    "control on top of CowClip's clip (which already bounds each row's gradient by its "
    "weight norm): not the paper's algorithm, and untested together"
)

#: FBGEMM's optimizers the CowClip update leaves out, with why (``EmbOptimType`` values).
REFUSED_OPTIMIZERS: Mapping[str, str] = {
    "partial_row_wise_adam": (
        "Adam with a per-element first and a per-row second moment is a third state layout "
        "for every kernel (native, Triton, Inductor) that no CowClip run uses; use adam, or "
        "exact_row_wise_adagrad for row-wise state"
    ),
    "lamb": _TRUST_RATIO,
    "partial_row_wise_lamb": _TRUST_RATIO,
    "lars_sgd": _TRUST_RATIO,
    "exact_row_wise_weighted_adagrad": (
        "its accumulator decays by a weighted count of the rows' past steps, a per-row "
        "counter the CowClip update does not keep; use exact_row_wise_adagrad"
    ),
    "ensemble_row_wise_adagrad": "an ensemble of tables per row is a model change, not a step rule",
    "ema_in_place_row_wise_adagrad": (
        "it replaces the weights by a moving average in place, which CowClip's clip "
        "(against the weight norm) would then read"
    ),
    "none": "the tables would not train; freeze them with requires_grad or lr=0",
}


def _known_optimizers() -> str:
    return "; ".join(
        f"{rule.name}: {', '.join(rule.torchrec_optimizers)}"
        for rule in UPDATE_RULES.values()
        if rule.torchrec_optimizers
    )


def _weight_decay_mode(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return value.name
    try:
        return _WEIGHT_DECAY_MODES[int(value)]
    except (KeyError, TypeError, ValueError):
        return str(value)


def fused_params_settings(
    fused_params: Optional[Mapping[str, Any]], where: str = "fused_params"
) -> Settings:
    """The ``CowClipOptions`` fields a sharder's ``fused_params`` set (see the module
    docstring); ``where`` names them in errors.

    Raises:
        ValueError: a key or value that cannot be honoured, named in one line.
    """
    if not fused_params:
        return {}
    params = dict(fused_params)
    known = _FBGEMM_KEYS + _TBE_KEYS + _OWN_KEYS
    unknown = [k for k in params if k not in known]
    if unknown:
        raise ValueError(
            f"{where}[{unknown[0]!r}] is not honoured by the CowClip update, which takes "
            f"{', '.join(known)}: drop it"
        )
    settings: Settings = {}

    def spelled(key: str) -> str:
        value = params[key]
        shown = _name_of(value) if key == "optimizer" else repr(value)
        return f"{where}[{key!r}]={shown}"

    hyperparameters = [k for k in _FBGEMM_KEYS[1:] if k in params]
    if "optimizer" in params:
        rule = torchrec_rule(params["optimizer"])
        if rule is None:
            why = REFUSED_OPTIMIZERS.get(_name_of(params["optimizer"]))
            if why is not None:
                raise ValueError(f"{spelled('optimizer')} is refused: {why}")
            raise ValueError(
                f"{spelled('optimizer')} is not an optimizer the CowClip update has "
                f"({_known_optimizers()})"
            )
        settings["optimizer"] = Setting(rule, spelled("optimizer"))
        for field, value in FBGEMM_DEFAULTS.items():
            settings[field] = Setting(value, f"FBGEMM's default {field}={value!r}", explicit=False)
    elif hyperparameters:
        raise ValueError(
            f"{where} set {hyperparameters} but no 'optimizer': FBGEMM would train its "
            "default EXACT_SGD; name the optimizer (e.g. 'optimizer': EmbOptimType.ADAM)"
        )
    if "learning_rate" in params:
        settings["lr"] = Setting(params["learning_rate"], spelled("learning_rate"))
    if "eps" in params:
        settings["eps"] = Setting(params["eps"], spelled("eps"))
    if "beta1" in params or "beta2" in params:
        default_1, default_2 = FBGEMM_DEFAULTS["betas"]
        betas = (params.get("beta1", default_1), params.get("beta2", default_2))
        shown = " ".join(spelled(k) for k in ("beta1", "beta2") if k in params)
        settings["betas"] = Setting(betas, shown)
    settings.update(_weight_decay_settings(params, where, spelled, settings.get("optimizer")))
    if "stochastic_rounding" in params:
        value = params["stochastic_rounding"]
        if not isinstance(value, bool):
            raise ValueError(f"{spelled('stochastic_rounding')}: give True or False")
        settings["stochastic_rounding"] = Setting(value, spelled("stochastic_rounding"))
    if "output_dtype" in params:
        value = params["output_dtype"]
        dtype = value if isinstance(value, torch.dtype) else _OUTPUT_TYPES.get(_name_of(value))
        if dtype not in _OUTPUT_TYPES.values():
            raise ValueError(
                f"{where}['output_dtype']={_name_of(value)} is refused: the pooled outputs "
                "are SparseType.FP32, FP16 or BF16 (quantized outputs are TorchRec's "
                "inference path: quantize_embeddings)"
            )
        settings["output_dtype"] = Setting(dtype, spelled("output_dtype"))
    for key in _OWN_KEYS:
        if key in params:
            value = params[key]
            settings[key] = Setting(
                frozenset(value) if key == "unclipped_tables" else value, spelled(key)
            )
    return settings


def _weight_decay_settings(
    params: Mapping[str, Any], where: str, spelled: Any, optimizer: Optional[Setting]
) -> Settings:
    mode = _weight_decay_mode(params.get("weight_decay_mode", 0))
    decay = params.get("weight_decay", 0.0)
    if mode == "COWCLIP":
        raise ValueError(
            f"{where}['weight_decay_mode']=COWCLIP is refused: FBGEMM's WeightDecayMode.COWCLIP "
            "clips against the number of steps each row has appeared in (cumulative unless "
            "a half-life > 0 decays it) and scales the row-wise Adagrad step, where CowClip (the paper) clips each row's "
            "gradient against its count in this batch; give 'cowclip': CowClip(r, zeta)"
        )
    if mode in ("DECOUPLE_GLOBAL", "COUNTER"):
        raise ValueError(
            f"{where}['weight_decay_mode']={mode} is refused: FBGEMM scales it by the steps "
            "since each row last appeared, a per-row counter the CowClip update does not "
            "keep; give WeightDecayMode.L2 (coupled, after the clip) or, with Adam, DECOUPLE"
        )
    if mode == "DECOUPLE":
        rule = None if optimizer is None else optimizer.value
        if rule not in ("adam", "adamw"):
            raise ValueError(
                f"{where}['weight_decay_mode']=DECOUPLE is honoured with Adam (AdamW), not "
                f"{rule or 'without an optimizer'}: give WeightDecayMode.L2 for coupled L2"
            )
        shown = " ".join(spelled(k) for k in ("optimizer", "weight_decay", "weight_decay_mode"))
        return {
            "optimizer": Setting("adamw", shown),
            "weight_decay": Setting(decay, shown),
        }
    if optimizer is not None and optimizer.value == "adamw" and decay:
        raise ValueError(
            f"{where}: AdamW's weight_decay is decoupled; give "
            "weight_decay_mode=WeightDecayMode.DECOUPLE with it"
        )
    if mode not in ("NONE", "L2"):
        raise ValueError(f"{where}['weight_decay_mode']={mode}: not a WeightDecayMode")
    if mode == "NONE" and decay:
        raise ValueError(
            f"{where}['weight_decay']={decay!r} would be ignored: FBGEMM applies it only "
            "with weight_decay_mode=WeightDecayMode.L2 (its default is NONE); give that "
            "mode for CowClip's coupled L2, or drop weight_decay"
        )
    if "weight_decay" not in params and "weight_decay_mode" not in params:
        return {}
    shown = " ".join(spelled(k) for k in ("weight_decay", "weight_decay_mode") if k in params)
    return {"weight_decay": Setting(decay, shown)}


def in_backward_settings(
    tables: Mapping[str, Optional[Tuple[type, Mapping[str, Any]]]],
) -> Settings:
    """The ``CowClipOptions`` fields that ``apply_optimizer_in_backward`` marks set.

    Args:
        tables: per table name, the ``(optimizer class, kwargs)`` its weight was marked
            with, or None for an unmarked weight.

    Every marked table must name the same optimizer and hyperparameters; a table whose
    ``cowclip`` is None while the others have one is unclipped (``unclipped_tables``).

    Raises:
        ValueError: some tables marked and others not, tables that disagree, or a class
            or keyword that cannot be honoured, named in one line.
    """
    marked = {name: mark for name, mark in tables.items() if mark is not None}
    if not marked:
        return {}
    unmarked = [name for name, mark in tables.items() if mark is None]
    if unmarked:
        raise ValueError(
            f"apply_optimizer_in_backward marks tables {sorted(marked)} but not {unmarked}: "
            "one fused update trains every table of a collection; mark them all"
        )
    classes = {name: _class_name(cls) for name, (cls, _) in marked.items()}
    if len(set(classes.values())) > 1:
        first = sorted(marked)[0]
        other = next(n for n in sorted(marked) if classes[n] != classes[first])
        raise ValueError(
            f"apply_optimizer_in_backward marks table '{first}' with {classes[first]} and "
            f"table '{other}' with {classes[other]}: one fused update trains every table "
            "of a collection alike; mark them all with one optimizer class"
        )
    per_table = {name: _table_settings(name, cls, kwargs) for name, (cls, kwargs) in marked.items()}
    clipped = {name: s for name, s in per_table.items() if _clip_of(s) is not None}
    unclipped = sorted(set(per_table) - set(clipped))
    reference = per_table[sorted(clipped or per_table)[0]]
    for name, settings in per_table.items():
        for field in set(reference) | set(settings):
            if field == "cowclip" and name in unclipped:
                continue
            mine, theirs = settings.get(field), reference.get(field)
            if _value(mine) != _value(theirs):
                raise ValueError(
                    f"{_spelled(theirs, field)} and {_spelled(mine, field)} disagree: one "
                    "fused update trains every table of a collection alike"
                )
    merged: Settings = dict(reference)
    if clipped and unclipped:
        merged["unclipped_tables"] = Setting(
            frozenset(unclipped),
            f"apply_optimizer_in_backward with cowclip=None on {unclipped}",
        )
    return merged


def _value(setting: Optional[Setting]) -> Any:
    return None if setting is None else _normal(setting.value)


def _spelled(setting: Optional[Setting], field: str) -> str:
    return setting.spelled if setting is not None else f"(no {field})"


def _clip_of(settings: Settings) -> Optional[CowClip]:
    clip = settings.get("cowclip")
    return CowClip() if clip is None else clip.value


def _table_settings(table: str, cls: type, kwargs: Mapping[str, Any]) -> Settings:
    where = f"apply_optimizer_in_backward({cls.__name__}) on '{table}'"
    qualified = f"{cls.__module__}.{cls.__qualname__}"
    if isinstance(cls, type) and issubclass(cls, CowClipInBackward):
        accepted = set(cls.hyperparameter_names)
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            raise ValueError(f"{where}: {cls.__name__} takes no {unknown[0]!r}")
        settings: Settings = {"optimizer": Setting(cls.rule, where)}
        for key, value in kwargs.items():
            settings[key] = Setting(value, f"{where} {key}={value!r}")
        return settings
    rule = torchrec_rule(qualified)
    if rule is None:
        raise ValueError(
            f"{where}: the CowClip update trains {_known_optimizers()}; or name "
            "torchrec_cowclip.optim.CowClipAdam / CowClipRowWiseAdagrad / CowClipSGD"
        )
    # TorchRec hands these keywords to FBGEMM (lr as learning_rate), so they mean what
    # they mean in fused_params; torch's `betas` spelling is read as beta1/beta2.
    params: Dict[str, Any] = {"optimizer": rule}
    if rule == "adamw" and "weight_decay" in kwargs:
        params["weight_decay_mode"] = 2  # AdamW's own decay: FBGEMM's DECOUPLE
    for key, value in kwargs.items():
        if key == "lr":
            params["learning_rate"] = value
        elif key == "betas":
            params["beta1"], params["beta2"] = value
        elif key in _OWN_KEYS:
            raise ValueError(
                f"{where}: {key}= is CowClip's; name torchrec_cowclip.optim.CowClip* classes"
            )
        else:
            params[key] = value
    return fused_params_settings(params, where)


#: What a mark on a built collection's tables cannot change: how its state is laid out
#: (the optimizer), which tables its batches clip, and whether it steps in two passes.
_BUILT_FIELDS = ("optimizer", "unclipped_tables", "helen")


def marked_options(current: CowClipOptions, marks: Settings) -> CowClipOptions:
    """The options of a built collection after ``apply_optimizer_in_backward`` marked its
    tables (``marks``: :func:`in_backward_settings` of them): the hyperparameters the
    marks state explicitly replace the collection's, as the sharder reads them; a field
    they leave out (FBGEMM's defaults included) keeps the collection's value.

    Raises:
        ValueError: the marks ask for another optimizer, other unclipped tables or Helen
            than the collection was built with, named in one line with what to do.
    """
    explicit = {name: s for name, s in marks.items() if s.explicit}
    if "cowclip" in explicit and "unclipped_tables" not in explicit:
        # CowClip* marks say of every table whether it is clipped.
        explicit["unclipped_tables"] = Setting(frozenset(), explicit["cowclip"].spelled)
    for name in _BUILT_FIELDS:
        setting = explicit.get(name)
        if setting is not None and _normal(setting.value) != _normal(getattr(current, name)):
            raise ValueError(
                f"{setting.spelled} asks for {name}={setting.value!r} but this "
                f"CowClipEmbeddingBagCollection was built with {name}="
                f"{getattr(current, name)!r}: build it with CowClipOptions({name}=...), or "
                "mark a stock EmbeddingBagCollection and convert it with "
                "CowClipEmbeddingBagCollection.from_ebc"
            )
    changes = {name: s.value for name, s in explicit.items() if name not in _BUILT_FIELDS}
    try:
        return current.replace(**changes)
    except (TypeError, ValueError) as e:
        spelled = "; ".join(s.spelled for s in explicit.values())
        raise ValueError(f"{e} (from {spelled})") from None


def converted_options(collection: nn.Module, options: Optional[CowClipOptions]) -> CowClipOptions:
    """The options a stock ``EmbeddingBagCollection`` converted to CowClip's trains with:
    ``options`` (None: none given) merged with its tables' ``apply_optimizer_in_backward``
    marks (:func:`resolve_options`: a disagreement raises ValueError naming both)."""
    marks = in_backward_settings(table_marks(collection))
    given = {} if options is None else options_settings(checked_options(options), "options=")
    return resolve_options([given, marks])


class LateMarks:
    """``apply_optimizer_in_backward`` (torch's or TorchRec's) called on a built
    collection's table weights: the hyperparameters the marks name become the
    collection's, as the sharder would set them; another optimizer, other unclipped
    tables or Helen are refused in one line, before anything changes
    (:func:`marked_options`). torch's own optimizer in a mark never steps: the tables get
    no ``.grad``. The marks are read again only after a new one was made anywhere
    (``compat.in_backward_mark_count``): a forward without one costs a comparison.

    Example::

        >>> from torchrec import EmbeddingBagConfig
        >>> from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
        >>> from torchrec_cowclip import CowClipEmbeddingBagCollection
        >>> ebc = CowClipEmbeddingBagCollection([EmbeddingBagConfig(
        ...     name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])])
        >>> late = LateMarks()
        >>> apply_optimizer_in_backward(
        ...     torch.optim.Adam, [ebc.embedding_bags["t"].weight], {"lr": 0.5})
        >>> late.pending(), late.read(ebc, ebc.options)["lr"], late.pending()
        (True, 0.5, False)
    """

    def __init__(self) -> None:
        self._read = in_backward_mark_count()

    def pending(self) -> bool:
        """Whether a mark was made since the last :meth:`read` (or since construction)."""
        return self._read != in_backward_mark_count()

    def read(self, collection: nn.Module, current: CowClipOptions) -> Dict[str, Any]:
        """The hyperparameters ``collection``'s marks set on top of ``current`` (its
        options now; ``{}`` when no table is marked), for its fused optimizer's
        ``param_groups[0]``. A refusal leaves the marks pending."""
        count = in_backward_mark_count()
        marks = in_backward_settings(table_marks(collection))
        hyperparameters = marked_options(current, marks).hyperparameters() if marks else {}
        self._read = count
        return hyperparameters


def options_settings(options: CowClipOptions, where: str) -> Settings:
    """Every field of ``options``, explicitly (``where``: ``options=``, a module's name)."""
    return {
        f.name: Setting(getattr(options, f.name), f"{where} {f.name}={getattr(options, f.name)!r}")
        for f in dataclasses.fields(options)
    }


def resolve_options(sources: Sequence[Settings]) -> CowClipOptions:
    """One ``CowClipOptions`` from the sources' settings (see the module docstring).

    Raises:
        ValueError: two sources set a field differently (both named), or a value is
            invalid (named by ``CowClipOptions``).
    """
    chosen: Dict[str, Any] = {}
    for f in dataclasses.fields(CowClipOptions):
        given = [s[f.name] for s in sources if f.name in s]
        pool = [s for s in given if s.explicit] or given
        if not pool:
            continue
        first = pool[0]
        for other in pool[1:]:
            if _normal(other.value) != _normal(first.value):
                raise ValueError(
                    f"{first.spelled} and {other.spelled} disagree on the tables' {f.name}: "
                    "give it once"
                )
        chosen[f.name] = first.value
    try:
        return CowClipOptions(**chosen)
    except (TypeError, ValueError) as e:
        spelled = "; ".join(s.spelled for src in sources for s in src.values() if s.explicit)
        raise ValueError(f"{e} (from {spelled})") from None


def _normal(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(float(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return frozenset(value)
    return value


def table_marks(
    collection: nn.Module,
) -> Dict[str, Optional[Tuple[type, Mapping[str, Any]]]]:
    """Per table of an embedding bag collection (its ``embedding_bags.<table>.weight``),
    the ``apply_optimizer_in_backward`` mark of its weight (None: unmarked), for
    :func:`in_backward_settings`."""
    bags = collection.get_submodule("embedding_bags")
    return {
        name.split(".")[0]: in_backward_optimizer(weight)
        for name, weight in bags.named_parameters()
    }


def _class_name(cls: Any) -> str:
    """An optimizer class as a user wrote it: ``torch.optim.Adam``, ``CowClipAdam``."""
    module = str(getattr(cls, "__module__", ""))
    name = str(getattr(cls, "__qualname__", cls))
    if module.startswith("torchrec_cowclip."):
        return name
    public = module.split(".")[:2] if module.startswith(("torch.", "torchrec.")) else [module]
    return ".".join([*public, name]) if module else name
