"""Prompt data: file sources (parquet/json/jsonl/csv), prompt building, and the checkpointable grain loader."""

from rlhf_jax.data.loader import (
    PromptBatch,
    PromptDataset,
    PromptLoader,
    build_dataset,
    dataset_from_config,
    loader_from_config,
)
from rlhf_jax.data.prompts import pad_left, render_prompt, tokenize_examples, truncate_ids
from rlhf_jax.data.records import Example, to_examples
from rlhf_jax.data.sources import DataError, Row, read_files

__all__ = [
    "DataError", "Example", "PromptBatch", "PromptDataset", "PromptLoader", "Row", "build_dataset",
    "dataset_from_config", "loader_from_config", "pad_left", "read_files", "render_prompt", "to_examples",
    "tokenize_examples", "truncate_ids",
]
