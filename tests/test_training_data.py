"""A run's data opened and checked (``train/data.py``): the refusals come before the
dense plan reads the training split."""

from __future__ import annotations

import pytest

from torchrec_cowclip.data.pipeline.dataset import CTRDataset
from torchrec_cowclip.data.settings import DataSettings
from torchrec_cowclip.failures import ConfigError
from torchrec_cowclip.train import data as training_data


def test_tables_beyond_memory_are_refused_before_the_dense_plan_reads_the_split(
    tmp_path, monkeypatch
):
    """Fitting the plan reads the whole training split (minutes on a large one): a model
    whose tables cannot fit is refused first."""
    data = DataSettings(
        "synthetic:2000", None, str(tmp_path), {"cardinality_scale": 0.001}, split_seed=0
    )

    def fit(*args, **kwargs):
        raise AssertionError("the dense plan was fitted before the tables were checked")

    monkeypatch.setattr(CTRDataset, "fit_dense_plan", fit)
    monkeypatch.setattr(training_data, "machine_memory_bytes", lambda process: 1 << 20)
    with pytest.raises(ConfigError, match=r"GiB of memory of this run's machines") as refused:
        training_data.open_training_data(data, 64, embedding_dim=1024, optimizer="adam")
    assert str(refused.value).endswith(
        "rows with --synthetic-max-cardinality (e.g. --synthetic-max-cardinality 1000000)"
    )
    monkeypatch.setattr(training_data, "machine_memory_bytes", lambda process: 1 << 40)
    with pytest.raises(AssertionError, match="the dense plan was fitted"):
        training_data.open_training_data(data, 64, embedding_dim=1024, optimizer="adam")
