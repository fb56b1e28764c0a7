"""Prompt data: JSONL/Parquet datasets and the built-in tasks, served as deterministic batches."""
