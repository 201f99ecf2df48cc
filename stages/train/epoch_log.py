"""The train stage's per-epoch MLflow points, logged by the driver as Ray Train (or the one-worker
host's Tune trial) commits each checkpoint.

Rank 0 had logged them itself, from a thread: importing mlflow and opening the store cost the
worker about 1.5 CPU seconds beside training, and on the 2-core demo epoch 2 took 2.4 s instead of
1.0 s. The driver has MLflow loaded already and only waits in `fit()`. A thread of the driver's lists
the run's folder, reads the history that every checkpoint's meta.json carries (stages.train.loop
writes it), and logs each epoch it has not logged yet, the epoch as MLflow's step: a point
appears within `poll_s` of its checkpoint's meta.json. A resumed run goes on after the last epoch
the MLflow run already holds (a driver killed between two polls had logged fewer than it trained).
"""
from __future__ import annotations

import json
import logging
import re
import threading
from typing import Any

from stages.common import storage, tracking

__all__ = ["EpochLog"]

log = logging.getLogger(__name__)

# stages.train.loop names each of Ray Train's checkpoints checkpoint-e<epoch>-s<step>-<attempt>;
# Tune numbers a trial's (stages.train.solo) checkpoint_<index>, in the order they were reported
_NAME = re.compile(r"checkpoint-e(\d+)-s(\d+)-|checkpoint_(\d+)$")
_STEP_KEY = "train_loss"  # in every epoch's row: the run's last logged epoch is its last step


class EpochLog:
    """`with EpochLog(handle, run_uri, s3): trainer.fit()` logs each committed epoch while the
    trainer runs, and at exit every epoch that the newest checkpoint holds. Nothing without a
    handle; a failure to read or log is logged at DEBUG (tracking warns once a store) and never
    reaches the run."""

    def __init__(self, handle: tracking.Handle | None, run_uri: str, s3: Any | None = None,
                 poll_s: float | None = None):
        self.handle, self.run_uri, self.s3 = handle, run_uri, s3
        self.poll_s = poll_s if poll_s is not None else (2.0 if storage.is_remote(run_uri) else 0.5)
        self.logged, self._seen = 0, ""
        self._fs = None  # one client for the run; each poll drops its listing cache (s3fs keeps one)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "EpochLog":
        if self.handle is not None:
            logged = tracking.last_step(self.handle, _STEP_KEY)  # None: the store failed (it warned once)
            self.logged = logged if logged is not None else 0
            self._thread = threading.Thread(target=self._watch, name="raymill-epochs", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.poll()  # the epochs committed since the last poll

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self) -> None:
        """Log the epochs of the newest checkpoint that are not logged yet."""
        try:
            for row in self._new_history() or []:
                if row["epoch"] > self.logged:
                    tracking.log_metrics(self.handle, tracking.epoch_metrics(row), step=int(row["epoch"]))
                    self.logged = row["epoch"]
        except Exception:  # noqa: BLE001: the points are a view of the run, never its failure
            log.debug("tracking: reading the epochs of %s failed", self.run_uri, exc_info=True)

    def _new_history(self) -> list[dict[str, Any]] | None:
        """The history of the newest checkpoint whose meta.json reads whole (one still being copied
        is passed over: a later poll reads it). None when there is none, or when it is the one
        read last."""
        if self._fs is None:
            self._fs = storage.filesystem(self.run_uri, self.s3)
        fs, root = self._fs
        fs.invalidate_cache(root)
        if not fs.exists(root):
            return None
        named = sorted(((tuple(int(g) for g in m.groups() if g is not None), p) for p in fs.ls(root, detail=False)
                        if (m := _NAME.match(p.rstrip("/").rsplit("/", 1)[-1]))), reverse=True)
        for _, path in named:
            if path == self._seen:
                return None
            try:
                history = json.loads(fs.cat_file(storage.join(path, "meta.json")))["history"]
            except (FileNotFoundError, ValueError, KeyError):
                continue
            self._seen = path
            return history
        return None
