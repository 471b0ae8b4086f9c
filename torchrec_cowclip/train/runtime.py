"""Where a training run executes: one process, or several with sharded tables.

The training loop (:mod:`.loop`) talks to one small interface, :class:`Runtime`: build
and wrap the model, produce this process's batches, run a step through TorchRec's train
pipeline, evaluate, and give or take the state a checkpoint holds. Two implementations:

* :class:`LocalRuntime`: the whole model in this process;
* :class:`ShardedRuntime`: under ``torchrun``/torchx, the tables are built on the meta
  device and ``DistributedModelParallel`` with the CowClip sharder allocates and
  initialises each rank's shards only, so no rank ever holds a whole table; every
  global batch is split over the ranks.

Both give checkpoints the same keys, so a run checkpointed by one resumes on the other.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Tuple, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist
from torchrec.optim.keyed import CombinedOptimizer

from torchrec_cowclip.data import BatchIterator, epoch_order
from torchrec_cowclip.distributed.comm import run_collective
from torchrec_cowclip.embedding.collection import CowClipEmbeddingBagCollection
from torchrec_cowclip.failures import ConfigError
from torchrec_cowclip.models.base import CTRModel
from torchrec_cowclip.models.spec import ModelSpec
from torchrec_cowclip.models.task import CTRTrainTask
from torchrec_cowclip.train.config import OptimizerSettings, RunSettings, TrainSettings
from torchrec_cowclip.train.console import ModelSize
from torchrec_cowclip.train.evaluate import evaluate
from torchrec_cowclip.train.helen_pipeline import (
    HelenTrainPipelineBase,
    HelenTrainPipelineSparseDist,
)
from torchrec_cowclip.train.optimizers import build_optimizer
from torchrec_cowclip.train.processes import (
    DistContext,
    init_distributed,
    rank_rows_for_eval,
    rank_rows_of_epoch,
    shard_model,
    table_shardings,
)

if TYPE_CHECKING:
    from torchrec_cowclip.distributed import ShardedCowClipEmbeddingBagCollection


def rng_state() -> Dict[str, Any]:
    """This process's Python, NumPy and torch RNG states, as tensors and plain values
    only (so a checkpoint holding them loads with ``weights_only=True``)."""
    # legacy=True: the ("MT19937", key, pos, has_gauss, cached) tuple.
    name, key, pos, has_gauss, cached = cast(
        Tuple[str, np.ndarray, int, int, float], np.random.get_state(legacy=True)
    )
    state = {
        "python": random.getstate(),
        "numpy": (name, key.tolist(), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restores :func:`rng_state`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass(frozen=True)
class RuntimeInputs:
    """What a runtime builds its part of the run from: the model to build, its optimizers,
    the loop's settings, the dataset and its training rows."""

    model: ModelSpec
    optimizers: OptimizerSettings
    run: RunSettings
    dataset: Any
    train_idx: np.ndarray


class Runtime(ABC):
    """One process's share of a training run (see the module docstring).

    Attributes:
        model: the CTR model (its tables sharded under :class:`ShardedRuntime`).
        train_module: what the train pipeline runs (``model`` with its loss).
        optimizer: dense Adam with warm-up plus the tables' fused optimizer.
        steps_per_epoch: optimizer steps in one epoch.
    """

    device: torch.device
    world_size: int = 1
    rank: int = 0
    sharding: Optional[str] = None
    model: CTRModel
    train_module: nn.Module
    optimizer: CombinedOptimizer
    steps_per_epoch: int
    model_size: ModelSize

    def __init__(self, inputs: RuntimeInputs) -> None:
        self.model_spec, self.optimizers, self.run = inputs.model, inputs.optimizers, inputs.run
        self.dataset, self.train_idx = inputs.dataset, inputs.train_idx
        optimizers = inputs.optimizers
        # The tables' training, resolved once (TrainConfig.resolve) and passed on as is to
        # the model factory, the collection and the sharder.
        self.embedding_options = optimizers.embedding

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _build_model(self, table_device: Optional[str]) -> CTRModel:
        # The dense plan's inputs: the columns, and their missing-value indicators if any.
        plan = getattr(self.dataset, "dense_plan", None)
        dense_inputs = self.dataset.schema.dense_names if plan is None else plan.output_names
        # The same arguments as a run folder rebuilds the model from.
        model = self.model_spec.build(
            self.dataset.schema,
            len(dense_inputs),
            embedding_options=self.embedding_options,
            device=self.device,
            table_device=table_device,
        )
        # Counted before sharding: the tables' configurations, the dense layers' sizes.
        self.model_size = ModelSize.of(
            model.embedding_collection.embedding_bag_configs(),
            sum(p.numel() for p in model.dense_parameters()),
        )
        return model

    # --- data ------------------------------------------------------------------------

    @abstractmethod
    def train_batches(self, epoch: int, start_batch: int) -> Iterator[Batch]:
        """This process's batches of ``epoch`` from batch ``start_batch`` on; the order
        is a function of (seed, epoch) alone, so a resumed run sees the same batches."""

    @abstractmethod
    def eval_batches(self, indices: np.ndarray) -> Iterator[Batch]:
        """This process's share of the evaluation rows ``indices``."""

    def evaluate(
        self, indices: np.ndarray, on_batch: Optional[Callable[[], None]] = None
    ) -> Dict[str, float]:
        """AUC and log-loss over all of ``indices`` (every rank gets the global figures);
        ``on_batch`` is called after each of this process's batches."""
        return evaluate(self.train_module, self.eval_batches(indices), self.device, on_batch)

    def eval_batch_count(self, indices: np.ndarray) -> int:
        """How many batches this process evaluates ``indices`` in."""
        return -(-len(indices) // self.run.eval_batch_size)

    def table_shardings(self) -> Dict[str, str]:
        """Each table's sharding type (empty on one process: nothing is sharded)."""
        return {}

    # --- steps -------------------------------------------------------------------------

    @abstractmethod
    def pipeline(self) -> Any:
        """A TorchRec train pipeline over :attr:`train_module` for one epoch (Helen's
        two-pass step when the run trains with Helen)."""

    def _trains_with_helen(self) -> bool:
        return getattr(self.embedding_module(), "helen", None) is not None

    def end_pipeline(self, pipeline: Any) -> None:
        """Releases what :meth:`pipeline` attached to the model."""

    def step(self, pipeline: Any, batches: Iterator[Batch], number: int) -> Any:
        """One training step of ``pipeline`` (``StopIteration`` at the epoch's end):
        ``(loss, logits, labels)`` of this process's part of the batch."""
        return pipeline.progress(batches)

    def step_summary(self, loss: float, samples: int, stop: bool) -> tuple[float, int, bool]:
        """``(mean loss, samples, stop)`` of the global batch from this process's
        ``(mean loss, samples, stop requested)``: whether any rank was asked to stop, so
        that every rank stops after the same step."""
        return loss, samples, stop

    def agree_to_stop(self, stop: bool) -> bool:
        """Whether any rank was asked to stop (collective when sharded)."""
        return stop

    def dense_lr(self) -> float:
        """The dense optimizer's learning rate now (warm-up included); NaN without one."""
        for name, opt in self.optimizer.optimizers:
            if name == "dense":
                return float(opt.param_groups[0]["lr"])
        return float("nan")

    @abstractmethod
    def embedding_module(self) -> nn.Module:
        """The (possibly sharded) embedding collection."""

    # --- state ---------------------------------------------------------------------------

    def tensors(self) -> Dict[str, Any]:
        """What a checkpoint holds as tensors, keyed alike in every runtime."""
        return {"model": self.train_module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_tensors(self, tensors: Dict[str, Any]) -> None:
        """Applies :meth:`tensors` after a checkpoint was loaded into them."""
        self.train_module.load_state_dict(tensors["model"])
        self.optimizer.load_state_dict(tensors["optimizer"])

    def model_tensors(self) -> Dict[str, Any]:
        """The model's weights alone (early stopping's best epoch)."""
        return {"model": self.train_module.state_dict()}

    def prepare_optimizer_state(self) -> None:
        """Creates the dense optimizer's state tensors, for a checkpoint to load into."""
        self.optimizer.init_state()

    @abstractmethod
    def table_counters(self) -> Optional[Dict[str, Tensor]]:
        """Per table, its global clip counters (None without CowClip tables)."""

    @abstractmethod
    def load_table_counters(self, counters: Dict[str, Tensor]) -> None:
        """Restores :meth:`table_counters`."""

    def all_rng_states(self) -> List[Dict[str, Any]]:
        """Every rank's RNG states, in rank order."""
        return [rng_state()]

    def barrier(self) -> None:
        """Waits for every rank."""


class LocalRuntime(Runtime):
    """The whole model in this process."""

    def __init__(self, inputs: RuntimeInputs, device: torch.device) -> None:
        super().__init__(inputs)
        run, optimizers, train_idx = inputs.run, inputs.optimizers, inputs.train_idx
        self.device = device
        self.model = self._build_model(table_device=None)
        self.train_module = CTRTrainTask(self.model)
        # The last incomplete batch of an epoch is dropped, as on N processes: the same
        # global batches on any number of processes (a resume may change it).
        self.steps_per_epoch = len(train_idx) // run.batch_size
        self.optimizer = build_optimizer(
            self.train_module, self.model.embedding_collection, optimizers, self.steps_per_epoch
        )

    def train_batches(self, epoch: int, start_batch: int) -> Iterator[Batch]:
        return iter(
            BatchIterator(
                self.dataset,
                self.train_idx,
                self.run.batch_size,
                shuffle=True,
                seed=self.run.seed,
                epoch=epoch,
                drop_last=True,
                start_batch=start_batch,
                prefetch=2,
            )
        )

    def eval_batches(self, indices: np.ndarray) -> Iterator[Batch]:
        return iter(BatchIterator(self.dataset, indices, self.run.eval_batch_size, prefetch=2))

    def pipeline(self) -> Any:
        kind = HelenTrainPipelineBase if self._trains_with_helen() else TrainPipelineBase
        return kind(self.train_module, self.optimizer, self.device)

    def embedding_module(self) -> nn.Module:
        ebc: nn.Module = self.model.embedding_collection
        return ebc

    def table_counters(self) -> Optional[Dict[str, Tensor]]:
        ebc = self.model.embedding_collection
        return ebc.table_counters() if isinstance(ebc, CowClipEmbeddingBagCollection) else None

    def load_table_counters(self, counters: Dict[str, Tensor]) -> None:
        self.model.embedding_collection.load_table_counters(counters)


class ShardedRuntime(Runtime):
    """This rank's shards of the tables and a replica of the dense layers.

    The tables are built on the meta device and materialised by
    ``DistributedModelParallel`` shard by shard (counter-based initialisation: the
    same start as one process), so per rank only its shards and their optimizer state
    are ever allocated.
    """

    def __init__(self, inputs: RuntimeInputs, ctx: DistContext) -> None:
        super().__init__(inputs)
        run, optimizers, train_idx = inputs.run, inputs.optimizers, inputs.train_idx
        if inputs.model.embedding_backend != "cowclip":
            raise ConfigError(
                "multi-process runs shard the CowClip tables: use --embedding-backend cowclip"
            )
        if run.row_clip_stats:
            raise ConfigError("--row-clip-stats counts rows of unsharded tables: run one process")
        from torchrec_cowclip.distributed import CowClipEmbeddingBagCollectionSharder

        self.ctx = ctx
        self.device, self.world_size, self.rank = ctx.device, ctx.world_size, ctx.rank
        self.sharding = run.sharding
        self.model = self._build_model(table_device="meta")
        ebc = self.model.embedding_collection
        sharder = CowClipEmbeddingBagCollectionSharder(module_type=type(ebc))
        self.train_module = shard_model(
            CTRTrainTask(self.model),
            [t.name for t in ebc.embedding_bag_configs()],
            [sharder],
            run.sharding,
            ctx,
            run.batch_size,
        )
        self.steps_per_epoch = len(train_idx) // run.batch_size
        self.optimizer = build_optimizer(
            self.train_module,
            None,
            optimizers,
            self.steps_per_epoch,
            fused=self.train_module.fused_optimizer,
        )

    def train_batches(self, epoch: int, start_batch: int) -> Iterator[Batch]:
        order = epoch_order(self.train_idx, True, self.run.seed, epoch)
        rows = rank_rows_of_epoch(order, self.run.batch_size, self.ctx)
        return iter(
            BatchIterator(
                self.dataset,
                rows,
                self.run.batch_size // self.world_size,
                start_batch=start_batch,
                prefetch=2,
            )
        )

    def eval_batches(self, indices: np.ndarray) -> Iterator[Batch]:
        rows, num_batches = rank_rows_for_eval(indices, self.run.eval_batch_size, self.ctx)
        return iter(BatchIterator(self.dataset, rows, num_batches=num_batches, prefetch=2))

    def evaluate(
        self, indices: np.ndarray, on_batch: Optional[Callable[[], None]] = None
    ) -> Dict[str, float]:
        return run_collective(
            f"evaluation of {len(indices):,} rows (sharded forwards, metric gather)",
            None,
            lambda: super(ShardedRuntime, self).evaluate(indices, on_batch),
        )

    def eval_batch_count(self, indices: np.ndarray) -> int:
        return rank_rows_for_eval(indices, self.run.eval_batch_size, self.ctx)[1]

    def table_shardings(self) -> Dict[str, str]:
        return table_shardings(self.train_module)

    def step(self, pipeline: Any, batches: Iterator[Batch], number: int) -> Any:
        return run_collective(
            f"training step {number} (TorchRec's input and output all-to-alls, DDP's "
            "gradient all-reduce)",
            None,
            lambda: pipeline.progress(batches),
        )

    def step_summary(self, loss: float, samples: int, stop: bool) -> tuple[float, int, bool]:
        summary = torch.tensor([loss * samples, samples, float(stop)], dtype=torch.float64)
        run_collective(
            "the step's loss and stop all-reduce", None, lambda: dist.all_reduce(summary)
        )
        total_loss, total, stops = summary.tolist()
        return total_loss / max(total, 1.0), int(total), stops > 0

    def agree_to_stop(self, stop: bool) -> bool:
        return self.step_summary(0.0, 0, stop)[2]

    def pipeline(self) -> Any:
        kind = (
            HelenTrainPipelineSparseDist if self._trains_with_helen() else TrainPipelineSparseDist
        )
        return kind(self.train_module, self.optimizer, self.device)

    def end_pipeline(self, pipeline: Any) -> None:
        # Restores the sharded modules' own forwards for evaluation and the next epoch.
        pipeline.detach()

    def embedding_module(self) -> ShardedCowClipEmbeddingBagCollection:
        from torchrec_cowclip.distributed import ShardedCowClipEmbeddingBagCollection

        return next(
            m
            for m in self.train_module.modules()
            if isinstance(m, ShardedCowClipEmbeddingBagCollection)
        )

    def table_counters(self) -> Optional[Dict[str, Tensor]]:
        return self.embedding_module().table_counters()

    def load_table_counters(self, counters: Dict[str, Tensor]) -> None:
        self.embedding_module().load_table_counters(counters)

    def all_rng_states(self) -> List[Dict[str, Any]]:
        states: List[Any] = [None] * self.world_size
        run_collective(
            "the RNG state gather", None, lambda: dist.all_gather_object(states, rng_state())
        )
        return states

    def barrier(self) -> None:
        dist.barrier()


def make_runtime(settings: TrainSettings, dataset: Any, train_idx: np.ndarray) -> Runtime:
    """A :class:`ShardedRuntime` under a multi-process launcher, else a :class:`LocalRuntime`."""
    run = settings.run
    ctx = init_distributed(settings.process, run.device, run.dist_timeout_s)
    inputs = RuntimeInputs(settings.model, settings.optimizers, run, dataset, train_idx)
    if ctx is not None:
        return ShardedRuntime(inputs, ctx)
    return LocalRuntime(inputs, resolve_device(run.device))


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
