"""Online inference on Ray Serve: a FastAPI ingress (REST and the Open Inference Protocol) -> model replicas."""
from stages.serve.app import apply_ingress_env, shutdown, start, update

__all__ = ["start", "update", "shutdown", "apply_ingress_env"]
