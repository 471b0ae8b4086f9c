"""Capacity planning before a launch (``torchrec-cowclip plan``): TorchRec's planner, run on
this machine with the model, sharder and planner a sharded ``train`` job uses, says how
the tables are sharded over N devices, what each rank holds, and whether it fits.

Example::

    >>> from torchrec_cowclip.plan import PRESETS, JobSpec, TableSpec, plan_job
    >>> tables = PRESETS["criteo-kaggle"].schema
    >>> spec = JobSpec(model="dlrm", optimizer="adam", batch_size=8192, world_size=1,
    ...                local_world_size=1, compute_device="cuda", hbm_bytes=16 << 30,
    ...                ddr_bytes=0, model_arguments=dict(
    ...                    num_dense=13, sparse_names=tables.sparse_names,
    ...                    cardinalities=tables.cardinalities, embedding_dim=64))
    >>> plan = plan_job(spec, per_host=8)
    >>> plan.fits, round(plan.table_bytes / 2**30, 2), plan.smallest_world_size
    (False, 24.15, 2)

Your own tables (``--tables FILE`` from Python), planned alone, rows as given, one
constrained to row-wise::

    >>> own = JobSpec.of_tables(
    ...     [TableSpec("user", 10_000_000, 64, sharding="row_wise"),
    ...      TableSpec("item", 2_000_000, 64, dtype="fp16")],
    ...     optimizer="adam", batch_size=4096, world_size=2, local_world_size=2,
    ...     compute_device="cuda", hbm_bytes=16 << 30, ddr_bytes=0)
    >>> plan = plan_job(own)
    >>> [(t.name, t.rows, t.sharding, t.dtype) for t in plan.tables]
    [('user', 10000000, 'row_wise', 'float32'), ('item', 2000000, 'row_wise', 'float16')]
    >>> plan.fits, [r.rank for r in plan.tight_ranks]
    (True, [])
"""

from torchrec_cowclip.plan.job import JobPlan, JobSpec, PlanError, RankPlan, TablePlan, plan_job
from torchrec_cowclip.plan.presets import PRESETS, TablePreset
from torchrec_cowclip.plan.tables import TableSpec, read_table_file

__all__ = [
    "JobPlan",
    "JobSpec",
    "PRESETS",
    "PlanError",
    "RankPlan",
    "TablePlan",
    "TablePreset",
    "TableSpec",
    "plan_job",
    "read_table_file",
]
