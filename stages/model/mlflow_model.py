"""The registered MLflow model: a published model.pt + model.json as an MLflow pyfunc.

MLflow's "models from code": `stages.common.tracking_model` logs this file with
`mlflow.pyfunc.log_model(python_model=<this file>)`, MLflow runs it when the model is loaded, and
`set_model` below hands MLflow the `Classifier`. No pickled Python object is stored: the model is
this file, the `stages` package shipped beside it (code_paths) and the two artifacts.

    model = mlflow.pyfunc.load_model("models:/raymill/3")
    model.predict(pd.DataFrame({"image": [jpeg_bytes, png_bytes]}))  # or a list of bytes

One row out per image: class_name, class_index, probability (top-1) and error. An image that does
not decode gets its reason in `error` (class_index -1, probability NA), as serve answers it, and the
batch goes on. Base64 text is taken for the bytes it encodes (`mlflow models serve`'s JSON).
"""
from __future__ import annotations

import base64
import logging
import re
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
import torch
from mlflow.pyfunc import PythonModel

from stages.etl.images import BadImage
from stages.etl import pixels as image_pixels
from stages.etl.sources import read_rules
from stages.model.predict import load_model, predict_arrays

__all__ = ["Classifier", "COLUMN", "OUTPUT_COLUMNS", "WEIGHTS", "INFO", "to_images", "decode"]

log = logging.getLogger(__name__)

COLUMN = "image"  # the input column of image bytes (the signature's one column)
OUTPUT_COLUMNS = ("class_name", "class_index", "probability", "error")
WEIGHTS, INFO = "model.pt", "model.json"  # the artifact names, as in the published model folder
BATCH = 64  # images a forward pass: bounds the decoded pixels held at once, whatever the input's size


def to_images(model_input: Any) -> list[Any]:
    """The images of an MLflow input: the `image` column of a DataFrame (or its one unnamed column,
    as MLflow frames a list or an unnamed Series), a Series, or a list / array of bytes.

    The signature's one column is unnamed (so that a plain list of bytes is accepted), and for such
    a signature MLflow hands the model only the DataFrame's first column. A frame whose `image`
    column came second was answered for its first column, silently: any other name is refused."""
    if isinstance(model_input, pd.DataFrame):
        if COLUMN in model_input.columns:
            return model_input[COLUMN].tolist()
        if list(model_input.columns) == [0]:
            return model_input[0].tolist()
        raise ValueError(f"the model reads images from a column named '{COLUMN}' (MLflow passes it only a "
                         f"DataFrame's first column), and got {list(model_input.columns)}: pass the encoded "
                         f"images (JPEG/PNG bytes) as the first column, named '{COLUMN}', or as a list of bytes")
    if isinstance(model_input, (bytes, bytearray)):
        return [model_input]
    if isinstance(model_input, (pd.Series, np.ndarray, list, tuple)):
        return list(model_input)
    raise ValueError(f"cannot read images from a {type(model_input).__name__}; pass a DataFrame with a "
                     f"'{COLUMN}' column of JPEG/PNG bytes, or a list of bytes")


def decode(data: Any, info: dict, rules: dict | None = None) -> tuple[np.ndarray | None, str | None]:
    """(pixels, None), or (None, "<reason>: <detail>") for an input that is not a usable image. Read
    with the model's own ETL rules (`rules`: model.json `read`), as `raymill infer` reads a file: the
    pyfunc had classified GIFs, oversized and too-many-pixel images its infer refuses, and refused
    formats its ETL allowed. Base64 text (a REST client's `instances`/`inputs`) is decoded first."""
    rules = rules or read_rules(info)
    if isinstance(data, str):
        data = data.encode("ascii", "replace")
    if isinstance(data, bytearray):
        data = bytes(data)
    if not isinstance(data, bytes):
        return None, f"not_bytes: got {type(data).__name__}; pass the encoded file's bytes (JPEG/PNG)"
    try:  # the size limit, then the formats and pixel limit: export clients' preprocess.py does the same
        return image_pixels.pixels(_unbase64(data), info["image_size"], info.get("resize", "crop"), rules), None
    except BadImage as e:
        return None, str(e)
    except Exception as e:  # hostile bytes can trip any decoder path: still this row's fault only
        return None, f"bad_image: the decoder failed ({type(e).__name__})"


_BASE64 = re.compile(rb"[A-Za-z0-9+/]+={0,2}")


def _unbase64(data: bytes) -> bytes:
    """`data` itself, or what it encodes when it is base64 text: no image format's bytes are (each
    begins with a byte or a length outside the alphabet), so an image is never taken for text."""
    text = data.strip()
    if len(text) % 4 or not _BASE64.fullmatch(text):
        return data
    return base64.b64decode(text)


class Classifier(PythonModel):
    """The published model behind `stages.model.predict`: the same eval transform and forward pass
    as infer and serve, so the registered model answers as they do."""

    def load_context(self, context) -> None:
        folder = Path(context.artifacts[INFO]).parent
        if Path(context.artifacts[WEIGHTS]).parent != folder:  # load_model reads one folder
            raise ValueError(f"the model's artifacts {WEIGHTS} and {INFO} are not in one folder; "
                             "log them with stages.common.tracking_model.log_model")
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model, self.info = load_model(str(folder))
        self.rules = read_rules(self.info)  # the model's own ETL read settings (model.json `read`)
        self.model = model.to(self.device)

    # The DataFrame hint: MLflow infers no schema from it and so warns of nothing; the logged
    # signature holds the schema, and a list of bytes is taken too (to_images).
    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        rows: list[dict[str, Any]] = []
        images = to_images(model_input)
        for start in range(0, len(images), BATCH):
            rows += self._predict_batch(images[start:start + BATCH])
        index = model_input.index if isinstance(model_input, (pd.DataFrame, pd.Series)) else None
        frame = pd.DataFrame(rows, columns=list(OUTPUT_COLUMNS), index=index)  # a row per input row, its label kept
        for name in ("class_name", "error"):  # None stays None: pandas had made it NaN beside a string
            frame[name] = pd.Series([row[name] for row in rows], dtype=object, index=frame.index)
        # nullable: an error row's is null in `mlflow models serve`'s JSON (NaN there is no JSON: strict
        # parsers, JavaScript's JSON.parse, refused the whole answer), and NA in pandas
        frame["probability"] = pd.Series([row["probability"] for row in rows], dtype="Float64", index=frame.index)
        return frame

    def _predict_batch(self, images: list[Any]) -> list[dict[str, Any]]:
        decoded = [decode(data, self.info, self.rules) for data in images]
        good = [pixels for pixels, error in decoded if error is None]
        answers = iter(predict_arrays(self.model, self.info, good, top_k=1, device=self.device))
        rows = []
        for pixels, error in decoded:
            if error is not None:
                rows.append({"class_name": None, "class_index": -1, "probability": None, "error": error})
                continue
            top = next(answers)
            rows.append({"class_name": top["class_name"], "class_index": top["class_index"],
                         "probability": top["top_k"][0]["probability"], "error": None})
        if len(good) < len(images):
            log.info("mlflow model: %d of %d images did not decode", len(images) - len(good), len(images))
        return rows


mlflow.models.set_model(Classifier())
