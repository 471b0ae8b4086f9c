"""Source formats: one module per ``KIND:`` spec of ``open_dataset`` (raw Criteo, TorchRec's
preprocessed Criteo npy days, Avazu, any CSV/TSV/parquet table, the built-in synthetic
generators), each a registered :class:`~torchrec_cowclip.data.registry.SourceKind` that
turns its files (or its generator) into validated row blocks for the pipeline."""
