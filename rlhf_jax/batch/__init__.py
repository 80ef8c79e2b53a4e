"""Batch layout between rollout and training: trimming padded columns and sequence packing."""

from rlhf_jax.batch.packing import PackedBatch, first_fit_decreasing, micro_layout, pack_batch, row_buckets, row_length
from rlhf_jax.batch.trim import trim_columns

__all__ = ["PackedBatch", "first_fit_decreasing", "micro_layout", "pack_batch", "row_buckets", "row_length", "trim_columns"]
