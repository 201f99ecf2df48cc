"""ETL: raw labelled images (a folder or an S3 prefix) -> checksummed parquet / WebDataset shards + manifest."""
from stages.etl.stage import check_apart, discover, run, verify

__all__ = ["run", "verify", "check_apart", "discover"]
