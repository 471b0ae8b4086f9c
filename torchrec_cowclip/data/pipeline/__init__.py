"""The pipeline every source runs through: the conversion of row blocks into the
memory-mapped binary cache (encode, writer, npy files), the cache's verification, the
opened dataset, its splits and its batches."""
