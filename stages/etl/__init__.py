"""ETL: raw labelled images (a folder or an S3 prefix) -> checksummed parquet / WebDataset shards + manifest."""
from stages.etl.stage import Listing, check_apart, check_output, discover, preflight, run
from stages.etl.integrity import verify

__all__ = ["run", "verify", "check_apart", "discover", "preflight", "check_output", "Listing"]
