"""The reliability sweep's one way to run the CLI in this process (scripts/reliability_sweep.py and its round-four
modules): `specheads.cli.main(argv)` with stdout and stderr captured; an escaping exception is recorded as a
traceback (exit -1), which fails its row."""
from __future__ import annotations

import contextlib
import io
import traceback


def run_in_process(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of specheads.cli.main(argv); argparse's SystemExit is its exit code."""
    from specheads import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as e:  # argparse
            rc = e.code if isinstance(e.code, int) else 2
        except BaseException:  # noqa: BLE001 - recorded: a traceback is a failed row
            err.write("TRACEBACK " + traceback.format_exc())
            rc = -1
    return rc, out.getvalue(), err.getvalue()
