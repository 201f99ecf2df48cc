"""One writer per output folder: an exclusive lock file `<out>/.raymill.lock` held for the whole run.

Two runs on one output would publish a manifest that names the other run's deleted shards, so
every stage that publishes takes this lock first, and a second run fails with exit 2 naming the
holder (owner, host, pid, since when).

- Local (and NFS) folders: `fcntl.flock` on the lock file. The kernel releases it when the holder
  dies, however it dies, so a lock left by a killed run is never stale: the next run takes it and
  says whose it was.
- S3: a conditional PUT (`If-None-Match: *`, AWS S3 since 2024-08, MinIO, moto) creates the lock
  object only if it is absent. The holder rewrites it every HEARTBEAT_S with `If-Match: <its ETag>`.
  A lock whose heartbeat is older than STALE_AFTER_S, or whose pid is gone on this host, is stale;
  it is taken over with `If-Match: <the stale ETag>`, so of two runs taking it over one wins.

The lock is re-entrant within a process (the pipeline holds its stage folder while the stage
function takes the same lock), and it checks that the folder's manifest, if any, is of `kind`.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import getpass
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from stages.common import storage
from stages.common.storage import MANIFEST
from stages.common.config import ConfigError

__all__ = ["LOCK_NAME", "STAGE_RECORD", "OutputLockedError", "OutputKindError", "output_lock", "check_output_kind",
           "foreign_files", "ensure_held", "HEARTBEAT_S", "STALE_AFTER_S"]

log = logging.getLogger(__name__)

LOCK_NAME = ".raymill.lock"
# The record `raymill run` keeps in each stage's folder (workflow/pipeline.py) beside the stage's files.
STAGE_RECORD = "stage.json"
HEARTBEAT_S = 30.0  # S3 only: how often the holder proves it is alive
STALE_AFTER_S = 180.0  # S3 only: a lock not refreshed for this long belongs to a dead run

_held: dict[str, tuple[int, int]] = {}  # lock path -> (holding thread, depth), for re-entrancy
_locks: dict[str, Any] = {}  # lock path -> the lock this process holds on it
_held_guard = threading.Lock()


class OutputLockedError(ConfigError):
    """Another run holds the output's lock."""


class OutputKindError(ConfigError):
    """The output folder holds another stage's published output."""


def check_output_kind(out: str, kind: str, s3: Any | None = None) -> None:
    """Refuse an output whose manifest.json is another stage's (publishing would unpublish it), or
    that lies inside a published output: train and infer had written among an ETL output's shards."""
    fs, root = storage.filesystem(out, s3)
    if fs.isfile(root):
        raise OutputKindError(f"{_what(kind)} '{out}' is a file; {'run.dir' if kind == 'pipeline' else '--output'} "
                              f"names a folder (new, or {'an earlier run' if kind == 'pipeline' else 'this stage'}"
                              "'s own)")
    if (parent := enclosing_output(out, s3)) is not None:
        raise OutputKindError(f"{_what(kind)} '{out}' is inside the {parent[1]} output '{parent[0]}'; choose "
                              f"{'a run.dir' if kind == 'pipeline' else 'an output'} outside it")
    try:
        manifest = storage.read_json_if_any(fs, storage.join(root, MANIFEST))
    except ValueError:  # not JSON: some other tool's file
        manifest = "non-raymill"
    if manifest is None:
        return
    found = manifest.get("kind", "unknown") if isinstance(manifest, dict) else "non-raymill"
    if kind == "pipeline":  # a run.dir holds no manifest of its own: any is another output's
        raise OutputKindError(f"run.dir '{out}' holds a published {found} output (its {MANIFEST}); a run there "
                              "would write among its files: choose an empty or new run.dir")
    if found != f"raymill.{kind}":
        raise OutputKindError(f"{_what(kind)} '{out}' holds a published {found} output (its {MANIFEST}); writing "
                              f"raymill.{kind} there would unpublish it. Choose another --output")


def enclosing_output(out: str, s3: Any | None = None) -> tuple[str, str] | None:
    """(folder, kind) of the nearest parent of a local `out` that is a published raymill output
    (its manifest.json names a raymill kind), else None. Local paths only: on S3 it would cost a
    request per parent prefix."""
    if storage.is_remote(out):
        return None
    fs, root = storage.filesystem(out, s3)
    for parent in Path(root).parents:
        try:
            found = storage.read_json(fs, storage.join(str(parent), MANIFEST)).get("kind")
        except (OSError, ValueError, AttributeError):  # none, a folder named manifest.json, not ours
            continue
        if isinstance(found, str) and found.startswith("raymill."):
            return str(parent), found
    return None


def foreign_files(out: str, own: Callable[[str], bool], s3: Any | None = None, at_most: int = 3,
                  listed: list[str] | None = None) -> list[str]:
    """Up to `at_most` files under the folder `out` (paths relative to it) that are not a stage's
    own (`own(relative path)`), the pipeline's STAGE_RECORD, nor hidden (a dotfile: locks, temp
    files): a user's images, say, which publishing beside would mix with the output and make the
    folder unreadable as an input. `listed`: the folder's `find`, when the caller has it."""
    fs, root = storage.filesystem(out, s3)
    if listed is None and not fs.isdir(root):
        return []
    found = []
    for rel in storage.files_under(fs, root, listed):
        if not rel.rsplit("/", 1)[-1].startswith(".") and rel != STAGE_RECORD and not own(rel):
            found.append(rel)
            if len(found) >= at_most:
                break
    return found


def _holder_info(token: str, kind: str) -> dict[str, Any]:
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    try:
        owner = getpass.getuser()
    except Exception:  # no user name in some containers
        owner = str(os.getuid())
    return {"owner": owner, "host": socket.gethostname(), "pid": os.getpid(), "kind": kind,
            "token": token, "since": now, "heartbeat_unix": time.time()}


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another run (holder details not readable)"
    return (f"a raymill {holder.get('kind', '?')} run of {holder.get('owner', '?')} on host "
            f"{holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {holder.get('since', '?')}")


def _what(kind: str) -> str:
    """What a message calls the locked folder: `raymill run`'s is its run.dir (it has no --output)."""
    return "run.dir" if kind == "pipeline" else "output"


def _locked_error(out: str, holder: dict[str, Any] | None) -> OutputLockedError:
    kind = (holder or {}).get("kind", "")
    return OutputLockedError(f"{_what(kind)} '{out}' is locked by {_describe(holder)} ({LOCK_NAME}). Wait for it "
                             f"to finish, or choose another output folder; a lock whose process is gone is "
                             f"taken over by itself")


@contextlib.contextmanager
def output_lock(out: str, kind: str, s3: Any | None = None) -> Iterator[None]:
    """Hold the exclusive lock on `out` (local folder or s3:// prefix) for the body of the `with`."""
    fs, path, key = _lock_path(out, s3)
    me = threading.get_ident()
    with _held_guard:
        owner, depth = _held.get(key, (me, 0))
        if depth and owner == me:
            _held[key] = (me, depth + 1)
    if depth and owner != me:  # re-entrant for the holding thread only: two threads of a notebook had
        # both passed, and each removed the other's shards as a killed run's (a published hole)
        raise OutputLockedError(f"{_what(kind)} '{out}' is locked by another thread of this process (pid "
                                f"{os.getpid()}), which runs a raymill stage into it; wait for it to finish, or "
                                f"choose another output folder")
    if depth:
        try:
            yield
        finally:
            with _held_guard:
                _held[key] = (me, _held[key][1] - 1)
        return
    check_output_kind(out, kind, s3)
    lock = _S3Lock(fs, path, out, kind) if storage.is_remote(out) else _LocalLock(path, out, kind)
    lock.acquire()
    with _held_guard:
        _held[key], _locks[key] = (me, 1), lock
    failed = False
    try:
        check_output_kind(out, kind, s3)  # again: the folder may have changed while we waited
        yield
    except BaseException:
        failed = True
        raise
    finally:
        with _held_guard:
            del _held[key], _locks[key]
        try:
            lock.release()
        except Exception as e:  # an S3 endpoint gone mid-run: report the run's own error, not this
            if not failed:
                raise
            log.warning("could not release the lock on '%s' (%s: %s); a later run takes it over once it "
                        "is stale", out, type(e).__name__, e)


def _lock_path(out: str, s3: Any | None) -> tuple[Any, str, str]:
    fs, root = storage.filesystem(out, s3)
    path = storage.join(root, LOCK_NAME)
    return fs, path, f"{'s3' if storage.is_remote(out) else 'file'}:{path}"


def ensure_held(out: str, s3: Any | None = None) -> None:
    """Raise OutputLockedError if this process's S3 lock on `out` now belongs to another run.

    An flock cannot be lost while its holder lives. An S3 lock can: a run whose heartbeats failed
    for STALE_AFTER_S looks dead and is taken over, and must then not publish over the new run.
    No-op for a folder this process holds no lock on.
    """
    key = _lock_path(out, s3)[2]
    with _held_guard:
        lock = _locks.get(key)
    if isinstance(lock, _S3Lock):
        lock.ensure()


class _LocalLock:
    def __init__(self, path: str, out: str, kind: str):
        self.path, self.out, self.kind, self.fd = path, out, kind, -1
        self.created: list[str] = []

    def acquire(self) -> None:
        import fcntl

        folder = os.path.dirname(self.path)
        missing, up = [], folder
        while not os.path.isdir(up) and os.path.dirname(up) != up:
            missing.append(up)
            up = os.path.dirname(up)
        self.created = missing  # deepest first
        try:
            os.makedirs(folder, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a name too long, a read-only or foreign folder: a usage error, nothing left
            self._remove_created()
            raise OutputKindError(f"{_what(self.kind)} '{self.out}' cannot be created or written "
                                  f"({e.strerror or type(e).__name__})"
                                  f"; name a folder you can write to") from None
        os.close(fd)
        for _ in range(20):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_json_fd(fd)
                os.close(fd)
                raise _locked_error(self.out, holder) from None
            # The previous holder may have unlinked the file between our open and our flock.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            raise OutputLockedError(f"could not lock '{self.out}': its {LOCK_NAME} keeps changing")
        previous = _read_json_fd(fd, tries=1)  # a dead holder's details, or an empty file: never wait
        if previous:
            log.warning("lock: took over %s from %s (that process is gone)", self.path, _describe(previous))
        data = json.dumps(_holder_info(uuid.uuid4().hex, self.kind)).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        self.fd = fd

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # while still locked: a waiter that opened it re-checks the inode
        os.close(self.fd)  # closing releases the flock
        self._remove_created()

    def _remove_created(self) -> None:
        """A run that failed before writing anything leaves no empty folders."""
        for folder in self.created:
            try:
                os.rmdir(folder)
            except OSError:
                if os.path.lexists(folder):  # not empty (the run wrote there)
                    break  # else never made: makedirs stopped above it (a name too long, say)


def _read_json_fd(fd: int, tries: int = 5) -> dict[str, Any] | None:
    for attempt in range(tries):  # a live holder writes its details just after taking the lock
        try:
            data = os.pread(fd, 65536, 0)
            if data:
                return json.loads(data)
        except (OSError, ValueError):
            pass
        if attempt + 1 < tries:
            time.sleep(0.05)
    return None


class _S3Lock:
    """Conditional PUTs on one object; a heartbeat thread keeps it fresh while the run lives."""

    def __init__(self, fs, path: str, out: str, kind: str):
        self.fs, self.path, self.out, self.kind = fs, path, out, kind
        self.info = _holder_info(uuid.uuid4().hex, kind)
        self.etag: str | None = None
        self._mutex = threading.Lock()  # a heartbeat's PUT and its new ETag are one step for ensure()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _put(self, **condition: str) -> str:
        self.info["heartbeat_unix"] = time.time()
        response = self.fs.pipe_file(self.path, json.dumps(self.info).encode(), **condition)
        return response["ETag"]

    def acquire(self) -> None:
        for _ in range(3):
            try:
                self.etag = self._put(mode="create")  # If-None-Match: *
                break
            except FileExistsError:
                pass
            except FileNotFoundError as e:  # s3fs: "The specified bucket does not exist"
                raise ConfigError(f"{_what(self.kind)} '{self.out}' cannot be written: {e}; create the bucket, or fix "
                                  "the s3:// path that names it") from None
            etag, holder = self._read()
            if etag is None:
                continue  # released between our PUT and our read: try again
            if not _is_stale(holder):
                raise _locked_error(self.out, holder)
            try:
                self.etag = self._put(IfMatch=etag)  # only one of several racing runs wins
                log.warning("lock: took over %s from %s (stale)", self.path, _describe(holder))
                break
            except OSError:
                continue  # someone else took it over first: look again
        else:
            raise _locked_error(self.out, self._read()[1])
        self._thread = threading.Thread(target=self._heartbeat, name="raymill-lock", daemon=True)
        self._thread.start()

    def _read(self) -> tuple[str | None, dict[str, Any] | None]:
        self.fs.invalidate_cache(self.path)
        try:
            etag = self.fs.info(self.path)["ETag"]
            holder = json.loads(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return None, None
        except ValueError:
            holder = None  # unreadable: treated by age alone below
        return etag, holder

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                with self._mutex:
                    self.etag = self._put(IfMatch=self.etag)
            except Exception as e:  # taken over (we looked dead) or the endpoint is down
                log.error("lock: could not refresh %s (%s); another run may take it over", self.path, e)

    def ensure(self) -> None:
        with self._mutex:
            etag, holder = self._read()
            mine = etag == self.etag
        if not mine:
            raise OutputLockedError(f"{_what(self.kind)} '{self.out}' lock ({LOCK_NAME}) was taken over by "
                                    f"{_describe(holder)} while this run held it (its heartbeat could not "
                                    f"be refreshed): nothing was published. Rerun once that run is done")

    def release(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        etag, _ = self._read()
        if etag == self.etag:  # never delete a lock another run took over
            self.fs.rm_file(self.path)


def _is_stale(holder: dict[str, Any] | None) -> bool:
    if not holder:
        return True
    age_s = time.time() - float(holder.get("heartbeat_unix", 0))
    if age_s > STALE_AFTER_S:
        return True
    if holder.get("host") == socket.gethostname() and holder.get("pid") != os.getpid():
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, ValueError, KeyError):
            return False
    return False
