"""Optimizer classes to name in TorchRec's ``apply_optimizer_in_backward``.

TorchRec marks a table's weight with the optimizer that trains it inside backward:
``apply_optimizer_in_backward(optimizer_class, [weight], kwargs)``. The CowClip sharder
and :meth:`~torchrec_cowclip.CowClipEmbeddingBagCollection.from_ebc` read that mark
(:mod:`.torchrec_config`); these classes let it carry CowClip's own settings -
``cowclip=``, ``count_lr=``, ``helen=`` - next to the optimizer's, so a TorchRec user
configures CowClip the way they configure FBGEMM's fused tables.

They describe the fused update; they cannot step a dense gradient (the clip needs each
row's count in the batch, which a dense gradient has lost). Their ``step`` refuses in
one line, naming the fix: shard the collection with the CowClip sharder, or convert it
with ``CowClipEmbeddingBagCollection.from_ebc``.

Example::

    >>> import torch
    >>> from torchrec_cowclip.optim.options import CowClip
    >>> weight = torch.nn.Parameter(torch.zeros(10, 4))
    >>> opt = CowClipAdam([weight], lr=1e-3, cowclip=CowClip(r=1.0, zeta=1e-5))
    >>> opt.defaults["lr"], opt.rule
    (0.001, 'adam')
    >>> opt.step()
    Traceback (most recent call last):
    ...
    RuntimeError: CowClipAdam configures the fused CowClip update of a table: ...
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Dict, Iterable, NoReturn, Optional, Tuple

import torch
from torch import Tensor

from torchrec_cowclip.optim.options import DEFAULT_OPTIONS, CountLR, CowClip, CowClipOptions, Helen

__all__ = ["CowClipAdam", "CowClipInBackward", "CowClipRowWiseAdagrad", "CowClipSGD"]


class CowClipInBackward(torch.optim.Optimizer):
    """Base of the classes below: the ``rule`` they name and their hyperparameters,
    validated at construction (:class:`~torchrec_cowclip.optim.options.CowClipOptions`).

    Args:
        params: the table weights.
        lr, betas, eps, weight_decay: as :class:`~torchrec_cowclip.optim.options.CowClipOptions`
            (``weight_decay`` is the coupled L2 added after the clip); ``betas`` and
            ``eps`` None: the defaults, for the rules that take them (a rule that does
            not - SGD's ``betas`` and ``eps``, row-wise Adagrad's ``betas`` - refuses them
            given).
        cowclip: the clip, or None for this table unclipped (DeepFM's first-order tables).
        count_lr: the optional per-id-frequency lr.
        helen: train with Helen's two-pass step.
    """

    #: The update rule (``CowClipOptions.optimizer``) the class names.
    rule: ClassVar[str]
    #: The hyperparameters its rule steps with: its param group's keys.
    hyperparameter_names: ClassVar[Tuple[str, ...]]

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = DEFAULT_OPTIONS.lr,
        betas: Optional[Tuple[float, float]] = None,
        eps: Optional[float] = None,
        weight_decay: float = DEFAULT_OPTIONS.weight_decay,
        cowclip: Optional[CowClip] = DEFAULT_OPTIONS.cowclip,
        count_lr: Optional[CountLR] = None,
        helen: Optional[Helen] = None,
    ) -> None:
        given = {"betas": betas, "eps": eps}
        for name, value in given.items():
            if value is not None and name not in self.hyperparameter_names:
                raise TypeError(f"{type(self).__name__} takes no {name!r}")
        values: Dict[str, Any] = {
            "lr": lr,
            "betas": DEFAULT_OPTIONS.betas if betas is None else betas,
            "eps": DEFAULT_OPTIONS.eps if eps is None else eps,
            "weight_decay": weight_decay,
            "cowclip": cowclip,
            "count_lr": count_lr,
            "helen": helen,
        }
        hyperparameters = {name: values[name] for name in self.hyperparameter_names}
        CowClipOptions(optimizer=self.rule, **hyperparameters)  # validates, names the bad one
        super().__init__(params, hyperparameters)

    def step(self, closure: Optional[Callable[[], float]] = None) -> NoReturn:
        raise RuntimeError(
            f"{type(self).__name__} configures the fused CowClip update of a table: it has "
            "no step on a dense gradient (the clip needs each row's count in the batch); "
            "shard the collection with torchrec_cowclip.distributed.get_default_sharders(), "
            "or convert it with CowClipEmbeddingBagCollection.from_ebc(ebc)"
        )


_CLIP = ("weight_decay", "cowclip", "count_lr", "helen")


class CowClipAdam(CowClipInBackward):
    """Adam with CowClip (the paper's), for ``apply_optimizer_in_backward`` (arguments as
    :class:`CowClipInBackward`'s)."""

    rule = "adam"
    hyperparameter_names = ("lr", "betas", "eps", *_CLIP)


class CowClipRowWiseAdagrad(CowClipInBackward):
    """Row-wise Adagrad with CowClip, for ``apply_optimizer_in_backward`` (arguments as
    :class:`CowClipInBackward`'s, without ``betas``)."""

    rule = "rowwise_adagrad"
    hyperparameter_names = ("lr", "eps", *_CLIP)


class CowClipSGD(CowClipInBackward):
    """SGD with CowClip, for ``apply_optimizer_in_backward`` (arguments as
    :class:`CowClipInBackward`'s, without ``betas`` and ``eps``)."""

    rule = "sgd"
    hyperparameter_names = ("lr", *_CLIP)
