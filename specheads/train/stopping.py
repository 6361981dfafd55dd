"""SIGINT and SIGTERM during training: stop at the next optimizer step with a checkpoint, not in the middle.

    with stop_requests() as stop:      # Trainer.train, around its loop
        ...                            # a signal sets stop.signum; the loop sees it (all processes agree on it in
                                       # Trainer._check_step) and calls stopped(...) after saving

A preempted job gets SIGTERM (SLURM, Kubernetes, `kill`), a user presses Ctrl-C: the first signal asks the loop to
finish the optimizer step it is in, save a checkpoint of it and leave with `Interrupted` (the CLI prints one line and
exits 128 + the signal; the run lock is released on the way out), so `train --resume` loses nothing. A second signal
stops at once, where it lands (the newest checkpoint is then the one to resume from). Outside the loop (setup,
evaluation at the end) the CLI's own handling applies: SIGINT and SIGTERM unwind as KeyboardInterrupt does.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
from dataclasses import dataclass
from typing import Iterator

from specheads.utils import Interrupted

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass
class StopRequest:
    signum: int | None = None  # the first signal received, None while none has come


@contextlib.contextmanager
def stop_requests() -> Iterator[StopRequest]:
    """Turn SIGINT / SIGTERM into a stop request while the block runs (main thread only: elsewhere Python cannot
    install handlers, and the request stays empty; an ignored SIGINT stays ignored); the previous handlers come back
    after."""
    req = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield req
        return

    def handler(signum, frame):
        if req.signum is not None:  # the second one: now
            raise Interrupted(signum, "a second signal: stopped at once; resume from the newest checkpoint")
        req.signum = signum
        log.warning("%s: finishing this optimizer step, then saving a checkpoint and stopping (send it again to "
                    "stop at once)", signal.Signals(signum).name)

    # a SIGINT ignored when the process started stays ignored (a background job: `nohup specheads train ... &`, or a
    # script's `&`, whose shell ignores it so that a Ctrl-C meant for the script's foreground leaves the job alone)
    taken = [s for s in SIGNALS if not (s == signal.SIGINT and signal.getsignal(s) == signal.SIG_IGN)]
    old = {s: signal.signal(s, handler) for s in taken}
    try:
        yield req
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def stopped(signum: int | None, step: int, checkpoint, resume_hint: str) -> Interrupted:
    """The exception that ends a run stopped by a signal after saving `checkpoint` at `step`."""
    return Interrupted(signum or signal.SIGTERM, f"stopped after step {step}; checkpoint {checkpoint} saved: "
                                                 f"{resume_hint}")
