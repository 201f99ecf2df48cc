"""How the CLI stops: Ctrl-C and SIGTERM end a command cleanly with one line (exit 130, 143); a
second one exits at once. `workflow.__main__` installs them; `take_sigterm` runs once Ray is up."""
from __future__ import annotations

import os
import signal
import sys
import threading

__all__ = ["first_interrupt", "second_interrupt", "take_sigterm", "terminate", "TERMINATED", "CLI"]


def first_interrupt(signum, frame) -> None:
    """Ctrl-C stops the command cleanly (KeyboardInterrupt: Ray shut down, the output unlocked, one
    line); a second one while that runs exits at once, also with one line: it had printed a
    traceback for each frame the two interrupts hit (three, in `raymill serve`'s shutdown)."""
    signal.signal(signal.SIGINT, second_interrupt)
    raise KeyboardInterrupt


TERMINATED: list[int] = []
CLI: list[bool] = []  # set by main() run as the command (argv from sys.argv), never for main([...])


def take_sigterm() -> None:
    """SIGTERM (kill, systemd, Kubernetes) stops the command as Ctrl-C does, exit 143. Installed once
    Ray is up: ray.init's core worker takes SIGTERM with a handler that dumps "*** SIGTERM received"
    and three `E ... logging.cc` lines, arms a 3 s abort (absl), and exits 130 through Ray's own."""
    if CLI and threading.current_thread() is threading.main_thread():  # a library caller keeps its own
        signal.signal(signal.SIGTERM, terminate)


def terminate(signum, frame) -> None:
    TERMINATED.append(signum)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))  # a second one: at once, as a second Ctrl-C
    if signal.getsignal(signal.SIGINT) is first_interrupt:
        signal.signal(signal.SIGINT, second_interrupt)
    raise KeyboardInterrupt


def second_interrupt(signum, frame) -> None:
    print("raymill: interrupted again; exiting now", file=sys.stderr, flush=True)
    os._exit(130)
