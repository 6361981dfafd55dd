"""The CLI is thin: every command is registered and user mistakes print one line, exit 2, no traceback."""
import subprocess
import sys

from specheads.cli import COMMANDS, build_parser, main


def test_all_commands_registered():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(COMMANDS) <= set(sub.choices)


def test_user_error_is_one_line(tmp_path, capsys):
    bad = tmp_path / "nope.yaml"
    rc = main(["prepare", "--config", str(bad)])
    err = capsys.readouterr().err
    assert rc == 2
    assert "nope.yaml" in err and "Traceback" not in err


def test_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "specheads", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and "specheads" in out.stdout
