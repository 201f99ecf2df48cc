"""Ray's known benign lines, kept off the terminal of a clean run (`--verbose` shows them, with a note).

Some lines that look like errors come from Ray's own actors and no public setting turns them off:
- Ray Core logs `E ... core_worker.cc: Actor with class name: '...' ... has constructor arguments
  in the object store and max_restarts > 0` when Ray Train creates its `PreemptionWatcher` and when
  Ray Data creates a `MapWorker` (ray-project/ray#53727). Those actors and their arguments are
  Ray's; the line is written by the C++ core worker of another process and reaches this terminal
  through Ray's log forwarding (`log_to_driver`), so no Python logger or filter can hold it back.

The driver's own core worker writes its copy (for Ray Data's MapWorker, created by the driver)
straight to file descriptor 2, below Python. So the CLI process filters its stderr at the
descriptor: fd 2 becomes a pipe, and a thread copies it to the real stderr line by line; a line
that matches a pattern below is dropped, every other byte passes through unchanged. The lines stay in Ray's session logs
(/tmp/ray/session_latest/logs). With `--verbose` nothing is dropped, and the first benign line of
each kind is followed by a one-line note saying why it is harmless.
"""
from __future__ import annotations

import atexit
import codecs
import os
import select
import sys
import threading
from typing import TextIO

__all__ = ["BENIGN", "BenignFilter", "install"]

# substring -> why it is harmless (the --verbose note)
BENIGN: dict[str, str] = {
    "has constructor arguments in the object store and max_restarts > 0":
        "Ray Core's note on actors that Ray Train (PreemptionWatcher) and Ray Data (MapWorker) create "
        "themselves; harmless for raymill's runs (ray-project/ray#53727)",
    # Train's DataConfig sets ExecutionOptions.exclude_resources on every dataset it splits
    # (train.ingest=ray_data); Ray 2.60 deprecates the option it sets itself. The warning, then its source line:
    "RayDeprecationWarning: `ExecutionOptions.exclude_resources` is deprecated":
        "Ray Train's own DataConfig sets this option for each dataset it splits; raymill sets nothing of it",
    "self.exclude_resources = exclude_resources":
        "the source line of Ray Train's DataConfig deprecation warning above",
    # Ray Data's banners from Train's split coordinator actors, every epoch of train.ingest=ray_data
    # (the driver's own Ray Data banners go to ray-data.log already: console.quiet_ray)
    "Starting execution of Dataset train": "Ray Data's banner as each epoch's execution starts",
    "Execution plan of Dataset train": "Ray Data's banner as each epoch's execution starts",
    "Progress bars disabled. To enable, set `ray.data.DataContext":
        "Ray Data's note on the progress bars raymill turns off outside --verbose",
    "✔️  Dataset train": "Ray Data's banner as each epoch's execution ends",
    # Tune's function trainable, as a resumed search's trial restores its checkpoint (raymill's
    # own line names the resume: "tune: resuming the search in ...")
    ") Restored on ": "Tune's note as a resumed trial loads its last checkpoint, which the resume line above covers",
    # raymill keeps token authentication on (Ray's default); its own dashboard line names the token
    "Token authentication is enabled for this Ray cluster":
        "Ray's default token authentication, which raymill keeps on (`ray get-auth-token` prints the token)",
}
QUIET_S = 0.05  # a partial line (a progress bar's redraw) is let through after this long without more
# A traceback that is benign only whole: a Ray worker that Ray stops with SIGTERM as a run ends
# while the garbage collector is in a WeakSet callback prints "Exception ignored in ..." and the
# SystemExit of Ray's own sigterm_handler (1 clean run in ~14 under load). Held from its first line
# and dropped only when it ends that way; any other ending lets every held line through.
SHUTDOWN_START = "Exception ignored in: <function WeakSet.__init__.<locals>._remove"
SHUTDOWN_NOTE = "a Ray worker stopped by Ray (SIGTERM) as the run ended, inside a garbage-collector callback"
HELD_LINES = 40


class BenignFilter:
    """Forwards whole lines to `target`, except those matching BENIGN.

    Partial lines are held until their newline, a carriage return (progress bars redraw with
    '\\r') or a flush, so a line that arrives in pieces (print writes the text, then '\\n') is
    judged whole.
    """

    def __init__(self, target: TextIO, verbose: bool = False):
        self.target, self.verbose, self._held, self._noted = target, verbose, "", set()
        self._block: list[str] = []  # the lines of a traceback that may be SHUTDOWN_START's

    def write(self, text: str) -> int:
        self._held += text
        while True:
            cut = min((i for i in (self._held.find("\n"), self._held.find("\r")) if i >= 0), default=-1)
            if cut < 0:
                return len(text)
            line, self._held = self._held[: cut + 1], self._held[cut + 1:]
            self._emit(line)

    def flush(self, final: bool = False) -> None:
        """Let a partial line through; `final` (the stream's end): a held traceback too, unjudged."""
        if self._held:
            line, self._held = self._held, ""
            self._emit(line)
        if final and self._block:
            block, self._block = self._block, []
            self.target.write("".join(block))
        self.target.flush()

    def _emit(self, line: str) -> None:
        if self._block or SHUTDOWN_START in line:
            self._block.append(line)
            if "SystemExit: 1" in line or len(self._block) > HELD_LINES:
                block, self._block = self._block, []
                benign = "SystemExit: 1" in line and any("sigterm_handler" in held for held in block)
                if not benign or self.verbose:
                    self.target.write("".join(block))
                if benign and self.verbose:
                    self.target.write(f"[raymill] note: the traceback above is benign: {SHUTDOWN_NOTE}\n")
            return
        kind = next((pattern for pattern in BENIGN if pattern in line), None)
        if kind is None or self.verbose:
            self.target.write(line)
        if kind is not None and self.verbose and kind not in self._noted:
            self._noted.add(kind)
            self.target.write(f"[raymill] note: the line above is benign: {BENIGN[kind]}\n")


class _Descriptor:
    """fd 2 through a pipe, copied to the real stderr by a thread through a BenignFilter."""

    def __init__(self, verbose: bool):
        sys.stderr.flush()
        self.saved = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self.out = BenignFilter(open(self.saved, "w", buffering=1, closefd=False, errors="replace"), verbose)
        self.thread = threading.Thread(target=self._pump, args=(read,), name="raymill-stderr", daemon=True)
        self.thread.start()
        atexit.register(self.close)

    def _pump(self, read: int) -> None:
        decode = codecs.getincrementaldecoder("utf-8")("replace").decode
        try:
            while chunk := os.read(read, 65536):
                self.out.write(decode(chunk))
                # print() writes a line's text and its newline apart: wait a moment for the rest
                # before letting a partial line through, so that it is judged whole
                if not select.select([read], [], [], QUIET_S)[0]:
                    self.out.flush()
        finally:  # never leave writers blocked on a pipe nobody reads
            os.dup2(self.saved, 2)
            self.out.flush(final=True)
            os.close(read)

    def close(self) -> None:
        """At exit: everything written so far reaches the terminal, then fd 2 is the terminal again."""
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(self.saved, 2)  # drops this process's write end: the pump reads to the end
        self.thread.join(timeout=2.0)


_installed: list[_Descriptor] = []


def install(verbose: bool) -> None:
    """Filter this process's stderr (once), at the descriptor: Python's writes, Ray's forwarded
    worker lines and the C++ core worker's own lines all pass through fd 2."""
    if not _installed:
        _installed.append(_Descriptor(verbose))
