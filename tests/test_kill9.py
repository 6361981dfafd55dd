"""kill -9 during prepare, train (mid-step, mid-save) and export, then a rerun or `train --resume` (issue 28): the
real CLI in processes of its own on the sweep's tiny target, killed at points found by polling the file system;
the rerun prints no traceback and leaves what an uninterrupted run leaves (safetensors tensors bit for bit, other
files byte for byte less timings), nothing half-written is where a later run reads, and no temporary or lock is
left. The kill points and the comparison are scripts/reliability_kill.py's (the sweep's `kill` rows run them too)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

import reliability_kill as kill9  # noqa: E402
import reliability_sweep  # noqa: E402

pytestmark = pytest.mark.slow  # 22 runs of the CLI, each a process importing torch (minutes on 2 busy cores)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The sweep's fixtures (target/, recipe.yaml, prepared/, trained/) and the uninterrupted runs (kill9-ref/)."""
    base = tmp_path_factory.mktemp("kill9")
    reliability_sweep.build_fixtures(base)
    kill9.references(base)
    return base


def _check(names: list[str], base: Path, work: Path, earlier: bool = False) -> None:
    o = kill9.run_kills([kill9.KILLS[n] for n in names], base, work, earlier=earlier)
    assert o.kills == [""] * len(names), o.kills  # each killed at its point, leaving nothing half-written
    assert o.rc == 0 and "Traceback" not in o.err, o.err[-3000:]
    assert o.differs == [], f"the rerun differs from the uninterrupted run in {o.differs}"
    assert o.temporaries == [], f"left after the rerun: {o.temporaries}"


def test_prepare_killed_in_a_shard_then_in_the_sidecars_reruns_to_the_same_features(base, tmp_path):
    _check(["prepare killed while writing feature shard 1", "prepare killed while writing the target sidecars"],
           base, tmp_path)


def test_prepare_killed_while_the_target_writes_the_answers_reruns_to_the_same_order(base, tmp_path):
    """issue 38: the rerun answered the rest in another batch and the answers came back in another order, so tokens,
    shards and the head differed; now data/regenerated.jsonl, data/tokens and features/ equal the uninterrupted
    run's."""
    _check(["prepare killed while the target writes the answers"], base, tmp_path)


def test_train_killed_mid_step_and_at_three_points_of_its_saves_resumes_bit_for_bit(base, tmp_path):
    """Killed mid-step (10 ms after checkpoint 3, before the step-6 save), as the step-6 checkpoint folder appears,
    in the step-6 save before its checksums, and while writing final/; each time resumed: the last resume ends as
    the uninterrupted run did."""
    _check(["train killed mid-step (after checkpoint 3)", "train killed as its checkpoint folder appears",
            "train killed mid-save, before the checksums", "train killed while writing final/"], base, tmp_path)


def test_train_stopped_by_sigterm_saves_says_so_and_resumes_bit_for_bit(base, tmp_path):
    """issue 38: SIGTERM (a preempted job) ended train with no save, no message and the lock left. Now it exits
    143 with one line naming the checkpoint of the step it was in and the command that continues it; no lock is
    left, and that --resume ends as the uninterrupted run did."""
    _check(["train stopped by SIGTERM mid-run (after checkpoint 3)"], base, tmp_path)


def test_export_killed_while_writing_leaves_nothing_at_out_and_reruns(base, tmp_path):
    _check(["export killed while writing"], base, tmp_path)


def test_export_killed_while_writing_over_an_earlier_export_keeps_it_and_reruns(base, tmp_path):
    _check(["export killed while writing over an earlier export"], base, tmp_path, earlier=True)


def test_export_killed_while_recording_its_source_reruns(base, tmp_path):
    _check(["export killed while recording its source"], base, tmp_path)


def test_prepare_killed_while_writing_its_manifest_leaves_no_temporary(base, tmp_path):
    _check(["prepare killed while writing its manifest"], base, tmp_path)
