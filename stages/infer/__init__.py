"""Batch inference: a published model over a folder, an S3 prefix or ETL shards, into a predictions table."""
from stages.infer.stage import run

__all__ = ["run"]
