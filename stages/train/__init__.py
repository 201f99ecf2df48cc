"""Training: PyTorch DDP on Ray Train over the ETL shards, with checkpoints, resume and a verdict on the feed."""
from stages.train.stage import check_image_size, published, run

__all__ = ["run", "published", "check_image_size"]
