"""The one exception type of the project, and the one way entry points turn it into a one-line message."""

from __future__ import annotations

import errno
import gc
import os
import signal
import sys
import threading
import zipfile
import zlib
from collections.abc import Callable


class NVError(Exception):
    """Bad input or an unusable resource (model, endpoint, params, cache).

    The message names the problem in one line; entry points print it without a traceback.
    """


PATH_ERRORS = (errno.EISDIR, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS)
NPZ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)  # reading a cut-short or damaged .npz


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler's or ``kill``'s stop), taken as Ctrl-C: work in flight is saved, then the exit."""


def _terminate(signum, frame) -> None:
    raise Terminated


def run_main(work: Callable[[], object]) -> int:
    """Run an entry point's ``work``: an NVError becomes ``error: MESSAGE`` on stderr and exit status 2, as do a
    full disk (ENOSPC, EDQUOT: the file it failed to write) and a path of the wrong kind or out of this user's reach
    (EISDIR, ENOTDIR, EACCES, EPERM, EROFS: the path); Ctrl-C exit status 130 and SIGTERM 143 (finished work is
    checkpointed, paid replies in flight are journaled, so the same command resumes), a closed stdout pipe exit status
    141 in silence, and a further Ctrl-C while the
    interrupted work's objects are freed (a progress bar's finalizer) ends the process at once; otherwise the status
    ``work`` returns when it is an int, else 0."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main else None
    interrupt = signal.getsignal(signal.SIGINT) if main else None  # None: a handler not set from Python, left as it is
    interrupted = False
    try:
        status = work()
        return status if isinstance(status, int) else 0
    except NVError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        interrupted = main
        if interrupted:  # one more Ctrl-C while the interrupted work is freed ends the process, not a finalizer's traceback
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        print("interrupted: finished work is checkpointed; rerun the same command to resume", file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130
    except BrokenPipeError:  # stdout's reader left (`nv attack --dry-run | head`): quiet, as a program SIGPIPE ends
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush would raise it again
        return 141
    except OSError as exc:
        if exc.errno in PATH_ERRORS and exc.filename:
            print(f"error: {exc.strerror}: {exc.filename}", file=sys.stderr)
            return 2
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" writing {exc.filename}" if exc.filename else ""
        print(f"error: no space left on the device{where}: free some and rerun the same command to resume "
              "(finished work is checkpointed)", file=sys.stderr)
        return 2
    finally:
        if interrupted:
            gc.collect()  # the interrupted work's reference cycles too, while SIGINT still ends the process
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if interrupted and interrupt is not None:
            signal.signal(signal.SIGINT, interrupt)
