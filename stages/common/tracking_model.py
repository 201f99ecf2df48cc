"""A tracked run's model as an MLflow pyfunc: what `mlflow.pyfunc.load_model("models:/raymill/<N>")` loads.

Logged with MLflow's own flavor API, as "models from code": the model is the file
`stages/model/mlflow_model.py`, named here by path (the ground floor imports no stage; MLflow runs
that file when the model loads), with model.pt + model.json as its artifacts.

The `stages` package travels with the model (code_paths) rather than as a `raymill` pip requirement:
raymill is not on PyPI, so `mlflow models serve` and any fresh environment built from the model's
requirements could not install it; and the code that made the predictions stays with the weights,
whatever raymill becomes later. Only `tracking` calls this (under its guard: a failure warns once).
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Iterator

__all__ = ["MODEL_CODE", "STAGES", "ARTIFACT_NAMES", "signature", "requirements", "log_model", "warm_up"]

log = logging.getLogger("stages.common.tracking")

STAGES = Path(__file__).resolve().parents[1]  # the `stages` package, shipped with the model
MODEL_CODE = STAGES / "model" / "mlflow_model.py"  # its PythonModel (stages.model.mlflow_model)
ARTIFACT_NAMES = ("model.pt", "model.json")  # as in the published folder: the names are its artifact keys
# What the model's code imports (stages.model.predict's closure, pandas for the pyfunc); mlflow adds
# itself. The `stages` code comes with the model, so `raymill`'s own pins are not needed here.
REQUIREMENTS = ("torch", "numpy", "pillow", "pandas", "pyarrow", "pydantic", "pyyaml", "fsspec")


def signature():
    """Image bytes in (one column), one row out per image; mirrors stages.model.mlflow_model's
    OUTPUT_COLUMNS (tests/test_mlflow_model.py checks that they agree)."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    # Optional where an undecodable image's row has no value (class_index is -1 there instead).
    outputs = Schema([ColSpec("string", "class_name", required=False), ColSpec("long", "class_index"),
                      ColSpec("double", "probability", required=False), ColSpec("string", "error", required=False)])
    # Unnamed: a DataFrame's one column of bytes and a plain list of bytes both pass MLflow's schema
    # check (a named column refused the list: "Model is missing inputs ['image']").
    return ModelSignature(inputs=Schema([ColSpec("binary")]), outputs=outputs)


def requirements() -> list[str]:
    """This environment's versions of what the model imports (no local tag: `2.5.1+cpu` is not on PyPI)."""
    return [f"{name}=={importlib.metadata.version(name).split('+')[0]}" for name in REQUIREMENTS]


@contextlib.contextmanager
def _active_run(uri: str, run_id: str) -> Iterator[None]:
    """The fluent API (log_model has no client form) pointed at `uri` and `run_id`, then put back:
    raymill talks to MLflow through clients everywhere else, and a notebook's own state stays."""
    import mlflow

    # None when unset: setting it back to None also unsets MLFLOW_TRACKING_URI, which set_tracking_uri
    # exports for subprocesses (a test's fresh process or a notebook's next run would inherit it).
    before = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    # Registering resolves the version's source (models:/<model id>) in the fluent tracking store,
    # even through a client: the registry must see `uri` as its tracking store too.
    mlflow.set_tracking_uri(uri)
    try:
        # nested: a notebook's own active run stays active; this one is the stage's run, resumed
        with mlflow.start_run(run_id=run_id, nested=mlflow.active_run() is not None):
            yield
    finally:
        mlflow.set_tracking_uri(before)


_WARM: list[threading.Thread] = []
# MLflow warns on every save without an input example; one of bytes needs a real image, which this
# floor cannot make (and MLflow would run the model on it), and the signature states the input. Set
# for the process, not in a `catch_warnings` block: that one is not thread-safe, and warm_up saves
# in a thread.
warnings.filterwarnings("ignore", message=".*An input example was not provided")


def warm_up() -> None:
    """Save a no-op pyfunc with this model's requirements to a temporary folder, in a thread, while
    the driver only waits for training. MLflow checks every pip requirement against the installed
    packages, and its first check maps every installed distribution to its modules: 2.9 s of the
    3.7 s `log_model` took at the end of the 2-core demo's train stage; the map is kept for the
    process. `log_model` waits for this thread, so the two never save at once."""
    if not _WARM:
        _WARM.append(threading.Thread(target=_save_noop, name="raymill-mlflow-model-warm", daemon=True))
        _WARM[0].start()


def _save_noop() -> None:
    try:
        import mlflow

        with tempfile.TemporaryDirectory() as tmp:  # the model's own code and signature: no warning of its own
            mlflow.pyfunc.save_model(str(Path(tmp, "warm")), python_model=str(MODEL_CODE), signature=signature(),
                                     pip_requirements=requirements())
    except Exception as e:  # noqa: BLE001: a head start only; the real log_model reports its own failure
        log.debug("tracking: the pyfunc warm-up failed (%s); log_model pays its cost", e)


def log_model(uri: str, run_id: str, files: dict[str, bytes], registered_name: str, name: str = "model") -> str:
    """Log `files` (model.pt + model.json) as the run's pyfunc model `name`, registered as a new
    version of `registered_name`; returns that version."""
    import mlflow

    for thread in _WARM:
        thread.join()

    missing = [n for n in ARTIFACT_NAMES if n not in files]
    if missing:
        raise FileNotFoundError(f"the published model has no {', '.join(missing)}; publish it again "
                                "(raymill train / tune) before tracking it")
    with tempfile.TemporaryDirectory() as tmp, _active_run(uri, run_id):
        for key in ARTIFACT_NAMES:
            Path(tmp, key).write_bytes(files[key])
        info = mlflow.pyfunc.log_model(
            name=name, python_model=str(MODEL_CODE), code_paths=[str(STAGES)],
            artifacts={key: str(Path(tmp, key)) for key in ARTIFACT_NAMES},
            signature=signature(), pip_requirements=requirements())
        # The client, not log_model's registered_model_name: that one prints its progress to stderr.
        version = _register(mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri), registered_name,
                            info.model_uri, run_id, info.model_id)
    # debug: the stage's one tracking line (tracking._finish) names the registered version already
    log.debug("tracking: logged the pyfunc model %s as %s v%s (%d KiB of weights)", info.model_uri,
              registered_name, version, len(files["model.pt"]) // 1024)
    return version


def _register(client, name: str, source: str, run_id: str, model_id: str) -> str:
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name, description="raymill image classifier: an MLflow pyfunc (image "
                                                          "bytes in, class out) over model.pt + model.json")
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    return str(client.create_model_version(name, source, run_id=run_id, model_id=model_id).version)
