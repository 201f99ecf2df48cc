"""Local and s3:// paths through one fsspec interface, plus atomic writes and checksums."""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import fsspec

__all__ = ["MANIFEST", "is_remote", "filesystem", "join", "write_bytes_atomic", "read_json", "read_json_if_any",
           "read_small", "read_small_if_any", "files_under", "children", "is_local", "shown", "sha256_file",
           "sha256_bytes", "s3_options", "local_path", "pyarrow_filesystem", "stored_raw", "check_location",
           "check_named", "check_output_place", "check_init_from"]

# Every output folder's publish marker (stages.common.artifacts writes it; locks reads its kind).
MANIFEST = "manifest.json"

CHUNK_BYTES = 4 * 1024 * 1024
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")  # RFC 3986's scheme: 'x://' of a local '/tmp/x://y' is none


def is_remote(uri: str) -> bool:
    return "://" in str(uri) and not str(uri).startswith("file://")


def check_location(uri: str) -> str:
    """`uri`, or ValueError: an s3:// URI needs a bucket and no empty path segment. S3 keeps
    `s3://b//x` as the key '/x', so a run's lock and files would land apart from what was named.
    A near miss of a URI ('s3:/b/x', 'gs:/b', 'S3://b/x', 'gs://b') is refused too: the first was a
    local folder './s3:/b/x' (exit 0), the others failed after Ray's start."""
    text = str(uri)
    scheme, sep, _ = text.partition("://")
    if sep and _SCHEME.fullmatch(scheme) and scheme not in ("s3", "file"):
        lower = scheme.lower()
        fix = (f"write it in lower case: {lower}://" if lower in ("s3", "file")
               else "use a local path or s3://bucket/prefix")
        raise ValueError(f"'{uri}' has the unsupported scheme '{scheme}://'; {fix}")
    first = text.split("/")[0]
    if not sep and first.endswith(":") and _SCHEME.fullmatch(first[:-1]) or not sep and text[:3].lower() == "s3:":
        raise ValueError(f"'{uri}' looks like a URI with a slash missing (it would be a local path starting "
                         f"with a folder named '{first}'); write s3://bucket/prefix, or ./{uri} for a local path")
    if not sep and text[:4].lower() == "s3//":
        raise ValueError(f"'{uri}' looks like an s3:// URI with its colon missing (it would be a local folder "
                         f"'{text[:2]}'); write s3://{text[4:]}, or ./{uri} for a local path")
    if str(uri).startswith("s3://"):
        bucket, _, key = str(uri)[len("s3://"):].partition("/")
        if not bucket or "//" in "/" + key.rstrip("/"):
            raise ValueError(f"'{uri}' has an empty path segment or no bucket; write s3://bucket/prefix "
                             "with single slashes")
    return uri


def check_named(uri: str) -> str:
    """`check_location`, and not empty or blank: that meant the current folder (`--output ""` wrote
    a dataset into it, `--input ""` read it)."""
    if not str(uri).strip():
        raise ValueError("is empty; name a folder or an s3:// prefix ('.' for the current folder)")
    return check_location(uri)


def check_init_from(uri: str) -> str:
    """train.init_from: `check_location`, and not blank: `--set train.init_from=` had started Ray,
    then looked for '/model.json'."""
    if not str(uri).strip():
        raise ValueError("is empty; name a weights file or a raymill train output, or null for random weights")
    return check_location(uri)


def check_output_place(uri: str) -> str:
    """`check_named`, and a local output is not under a file: the stage failed there with
    NotADirectoryError, exit 1, after Ray's start. (An output that is a file is each stage's
    output check's: stages.common.locks.)"""
    uri = check_named(uri)
    if not is_remote(uri):
        there = next((p for p in Path(local_path(uri)).parents if p.exists()), None)
        if there is not None and not there.is_dir():
            raise ValueError(f"'{there}' is a file; name a folder (new or a raymill output) or an s3:// prefix")
    return uri


def local_path(uri: str) -> str:
    """Absolute local path of a non-remote URI (expands ~)."""
    uri = str(uri)
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    return str(Path(uri).expanduser().resolve())


def s3_options(s3: Any | None) -> dict[str, Any]:
    """Plain-dict S3 settings (picklable, for Ray tasks). Credentials stay in the environment."""
    endpoint = getattr(s3, "endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL") \
        or os.environ.get("AWS_ENDPOINT_URL_S3")
    return {"endpoint_url": endpoint, "region": getattr(s3, "region", None),
            "anon": bool(getattr(s3, "anon", False)), "max_attempts": getattr(s3, "max_attempts", None)}


def pyarrow_filesystem(uri: str, s3: Any | None):
    """(pyarrow filesystem or None, path) for Ray Train/Tune `storage_path`.

    Ray builds its own filesystem from a plain path, but a custom S3 endpoint (MinIO, moto)
    only reaches it through an explicit `pyarrow.fs.S3FileSystem`.
    """
    uri = str(uri)
    if not uri.startswith("s3://"):
        return None, local_path(uri)
    import pyarrow.fs as pafs

    opts = s3 if isinstance(s3, dict) else s3_options(s3)
    kwargs: dict[str, Any] = {"region": opts.get("region") or "us-east-1", "anonymous": opts.get("anon", False)}
    if opts.get("endpoint_url"):
        scheme, _, host = opts["endpoint_url"].partition("://")
        kwargs.update(endpoint_override=host, scheme=scheme)
    if opts.get("max_attempts"):
        kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=opts["max_attempts"])
    return pafs.S3FileSystem(**kwargs), uri[len("s3://"):].rstrip("/")


def stored_raw(etl_manifest: dict[str, Any], data_format: str) -> bool:
    """Whether shards of `data_format` in this ETL output hold raw uint8 pixels (no decode).

    The one place this is decided: tar shards are always encoded; parquet follows
    `etl.parquet_encoding`.
    """
    return data_format == "parquet" and etl_manifest["config"]["parquet_encoding"] == "raw"


def filesystem(uri: str, s3: Any | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return (filesystem, path-within-it) for a local path or s3:// URI.

    `s3` is an S3Config or the dict from `s3_options` (what Ray tasks receive).
    """
    uri = str(uri)
    if uri.startswith("s3://"):
        import s3fs

        opts = s3 if isinstance(s3, dict) else s3_options(s3)
        client_kwargs = {k: v for k, v in (("endpoint_url", opts.get("endpoint_url")),
                                           ("region_name", opts.get("region"))) if v}
        # Each request is retried by botocore (5 attempts with backoff by default): against an
        # endpoint that died mid-write, a small ETL took 70 s to fail with the default, 14 s with 1.
        retries = {"config_kwargs": {"retries": {"max_attempts": opts["max_attempts"]}}} \
            if opts.get("max_attempts") else {}
        # skip_instance_cache: tests start and stop endpoints; a cached client would outlive them.
        fs = s3fs.S3FileSystem(anon=opts.get("anon", False), client_kwargs=client_kwargs,
                               skip_instance_cache=True, **retries)
        return fs, uri[len("s3://"):].rstrip("/")
    if is_remote(uri):
        raise ValueError(f"unsupported URI scheme in '{uri}'; use a local path or s3://bucket/prefix")
    return fsspec.filesystem("file"), local_path(uri)


def join(uri: str, *parts: str) -> str:
    uri = str(uri).rstrip("/")
    return "/".join([uri, *[p.strip("/") for p in parts]])


def _umask() -> int:
    """This process's umask, read without changing it (os.umask sets it: racy beside threads)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # no /proc (macOS): set and put back at import
    os.umask(mask)
    return mask


# Files are created with 0o666 & ~umask, as open() makes them.
_UMASK = _umask()


def write_bytes_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write so readers see the old object or the whole new one, never a prefix.

    Local: temp file in the same folder + os.replace. S3: one PUT is already atomic.
    """
    if is_local(fs):
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp's 0600 had made every output unreadable to others
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    else:
        fs.pipe_file(path, data)


def files_under(fs: fsspec.AbstractFileSystem, root: str, listed: list[str] | None = None) -> list[str]:
    """Every file under the folder `root` as a path relative to it, from one listing (a LIST on
    S3, not a request per file). `listed`: the folder's `fs.find(root)`, when the caller has it."""
    prefix = root.rstrip("/") + "/"
    relative = [p[len(prefix):] if p.startswith(prefix) else p.rsplit("/", 1)[-1]
                for p in (fs.find(root) if listed is None else listed)]
    return [r for r in relative if r and not r.endswith("/")]  # an object store's folder markers: no files


def children(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    """The entries directly in the folder `root`, without the folder itself: s3fs lists a zero-byte
    `root/` folder marker (Ray Tune's storage writes them, the S3 console's "Create folder" too) as an
    entry of its own, and deleting it recursively had deleted the whole prefix, a held lock with it."""
    me = root.rstrip("/")
    return [p for p in fs.ls(root, detail=False) if p.rstrip("/") != me]


def shown(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """A path of `fs` as a user names it: `s3://bucket/key` on an object store (fsspec's paths drop
    the scheme, and warnings had named S3 folders as 'bucket/key')."""
    return path if is_local(fs) else fs.unstrip_protocol(path)


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def read_small(fs: fsspec.AbstractFileSystem, path: str) -> bytes:
    """A small file's bytes in one GET on S3: `fs.open`, and s3fs's `cat_file` with its default
    concurrency, ask for the object's size first (a HEAD more per read)."""
    return fs.cat_file(path, max_concurrency=1) if _takes_concurrency(type(fs)) else fs.cat_file(path)


@functools.cache
def _takes_concurrency(kind: type) -> bool:  # s3fs's newer cat_file; older ones read in one GET anyway
    method = getattr(kind, "_cat_file", None)
    return method is not None and "max_concurrency" in inspect.signature(method).parameters


def read_small_if_any(fs: fsspec.AbstractFileSystem, path: str) -> bytes | None:
    """`read_small`, or None when there is no such file: one request where exists() + read were two."""
    try:
        return read_small(fs, path)
    except FileNotFoundError:
        return None
    except OSError:  # a name too long, a parent that is a file: no such file, as exists() had said
        if is_local(fs) and not os.path.lexists(path):
            return None
        raise


def read_json(fs: fsspec.AbstractFileSystem, path: str) -> Any:
    return json.loads(read_small(fs, path))


def read_json_if_any(fs: fsspec.AbstractFileSystem, path: str, default: Any = None) -> Any:
    """`read_json`, or `default` when there is no such file."""
    data = read_small_if_any(fs, path)
    return default if data is None else json.loads(data)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(fs: fsspec.AbstractFileSystem, path: str) -> tuple[str, int]:
    """(sha256 hex, size in bytes) of a file, streamed in chunks."""
    digest, size = hashlib.sha256(), 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size
