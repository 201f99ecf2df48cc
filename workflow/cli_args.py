"""The CLI's arguments: each command, its flags and their checks (a bad path is a usage error, exit 2)."""
from __future__ import annotations

import argparse

from stages.common import storage

__all__ = ["build_parser", "unread_overrides"]

# The config sections a stage command reads; a --set of another section does nothing there (a user's
# `raymill train --set etl.image_size=64` had trained at the data's 48 px without a word)
READS = {"train": ("train", "ray", "s3", "tracking", "run"), "tune": ("tune", "train", "ray", "s3", "tracking", "run"),
         "infer": ("infer", "ray", "s3", "tracking", "run", "etl"), "serve": ("serve", "ray", "s3"),
         "export": ("export", "s3", "tracking")}


def unread_overrides(args: argparse.Namespace) -> str | None:
    """A warning for the --set keys that `args.command` does not read, or None."""
    reads = READS.get(args.command)
    unread = [o.split("=", 1)[0] for o in getattr(args, "overrides", ()) or ()
              if reads and o.split("=", 1)[0].split(".", 1)[0] not in reads]
    if not unread:
        return None
    owners = sorted({k.split(".", 1)[0] for k in unread})
    return (f"raymill {args.command}: --set {', '.join(unread)} does nothing here: it reads "
            f"{', '.join(s + '.*' for s in reads)}; {', '.join(s + '.*' for s in owners)} are read by other commands "
            f"(`raymill run` reads them all)")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (default: built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set etl.image_size=64 (repeatable)")
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="also show Ray's own log lines and full tracebacks")


def _location(value: str, check=storage.check_named) -> str:
    try:
        return check(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _output(value: str) -> str:
    return _location(value, storage.check_output_place)


def _local_output(value: str) -> str:
    """demo-data writes with pathlib: an s3:// URI had become a local folder './s3:/b/x', exit 0."""
    if storage.is_remote(_output(value)):
        raise argparse.ArgumentTypeError(f"'{value}' is remote; demo-data writes a local folder (copy it to S3 "
                                         "afterwards, e.g. with `aws s3 sync`)")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raymill", description="Ray-based ETL -> train -> tune -> serve")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also show Ray's own log lines and full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo-data", help="write the built-in demo ImageFolder dataset (10 shape classes)")
    p.add_argument("out", type=_local_output, help="local folder to write <out>/<class>/<image> into")
    p.add_argument("--images", type=int, default=1500, help="how many images, over the 10 classes (default 1500)")
    p.add_argument("--seed", type=int, default=0, help="the same seed writes the same bytes (default 0)")

    p = sub.add_parser("etl", help="images (folder or s3://) -> parquet/tar shards + manifest")
    p.add_argument("--input", required=True, type=_location, help="ImageFolder tree: <input>/<class>/<image>, or <input>/<split>/<class>/<image>")
    p.add_argument("--output", required=True, type=_output, help="output folder or s3:// prefix")
    p.add_argument("--format", choices=["parquet", "tar", "both"], default=None,
                   help="shard format(s) (default: etl.formats from config)")
    p.add_argument("--overwrite", action="store_true", help="replace a published output atomically")
    _common(p)

    p = sub.add_parser("verify", help="recheck shard sizes, checksums and row counts")
    p.add_argument("dst", type=_location)
    _common(p)

    p = sub.add_parser("train", help="DDP training on an ETL output; exports model.pt + model.json")
    p.add_argument("--data", required=True, type=_location, help="ETL output folder or s3:// prefix")
    p.add_argument("--output", required=True, type=_output, help="run folder for the model, metrics and checkpoints")
    p.add_argument("--overwrite", action="store_true",
                   help="discard the output's checkpoints (Ray run state) and train from scratch")
    _common(p)

    p = sub.add_parser("tune", help="hyperparameter search (ASHA, PBT or FIFO) over the trainer")
    p.add_argument("--data", required=True, type=_location, help="ETL output folder or s3:// prefix")
    p.add_argument("--output", required=True, type=_output, help="folder for the best model, trials.md and the search")
    _common(p)

    _model_parsers(sub)
    _export_parser(sub)

    p = sub.add_parser("doctor", help="what the Ray sessions on this machine expose: every listening port, classified")
    p.add_argument("--pid", type=int, default=None, help="only this process and its descendants (a raymill command)")
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="as raymill -v")

    p = sub.add_parser("run", help="the whole pipeline: ETL -> train -> (tune) -> infer -> (export)",
                       description="ETL -> train -> (tune) -> infer -> (export) -> (serve) into run.dir; a stage "
                                   "whose inputs and config are unchanged is reused")
    p.add_argument("--serve", action="store_true", help="then serve the model and send test requests")
    p.add_argument("--force", action="store_true", help="recompute stages even if unchanged")
    _common(p)
    return parser


def _model_parsers(sub) -> None:
    p = sub.add_parser("infer", help="batch inference (Ray Data; a small job in this process) -> predictions + "
                                     "metrics.json")
    p.add_argument("--model", required=True, type=_location, help="train/tune output folder (model.pt + model.json)")
    p.add_argument("--data", required=True, type=_location, help="ETL output (uses infer.split) or a raw image folder")
    p.add_argument("--output", required=True, type=_output, help="folder for the predictions and metrics")
    _common(p)

    p = sub.add_parser("serve", help="online inference over HTTP (Ray Serve, dynamic batching)")
    p.add_argument("--model", required=True, type=_location, help="train/tune output folder (model.pt + model.json)")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1; other interfaces only when asked)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default serve.port, 8000); a port where "
                                                           "`raymill serve` answers is rolled to --model")
    p.add_argument("--replicas", type=int, default=None, help="model replicas (default serve.num_replicas)")
    _common(p)


def _export_parser(sub) -> None:
    p = sub.add_parser("export", help="a model -> ONNX (or TorchScript) in a Triton/KServe model repository, checked")
    p.add_argument("--model", required=True, type=_location, help="train/tune output folder (model.pt + model.json)")
    p.add_argument("--output", required=True, type=_output,
                   help="model repository folder: new, empty, or an earlier export (replaced)")
    p.add_argument("--format", choices=["onnx", "torchscript"], default=None,
                   help="default: export.format from config (onnx)")
    p.add_argument("--data", default=None, type=_location,
                   help="what the export is checked on: an ETL output, or a folder of images (default: the "
                        "model's own ETL output, model.json's data)")
    _common(p)
