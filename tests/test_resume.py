"""Resume without unpickling, bit for bit: a crafted pickle in a checkpoint never runs, and a run stopped twice and
killed inside a checkpoint save ends with the same weights as an uninterrupted one, with the feature noise on."""
from __future__ import annotations

import json
import os

import pytest
import torch

from test_train import make_head, make_recipe, state, token_samples

from specheads.train.checkpoint import list_checkpoints
from specheads.train.trainer import Trainer
from specheads.utils import SpecheadsError


def assert_trained(before: dict, head, target_before: dict, target) -> None:
    """A run whose weights a test compares must move them (TRL's check): every trainable parameter of the head
    changed, the frozen target did not. Equal weights after steps that change nothing would prove nothing."""
    after = state(head)
    trainable = [n for n, p in head.named_parameters() if p.requires_grad]
    still = [n for n in trainable if torch.equal(before[n], after[n])]
    assert trainable and not still, f"training left {still} unchanged (loss 0? every row masked?)"
    assert all(torch.equal(v, target.model.state_dict()[k]) for k, v in target_before.items()), "target changed"


def target_state(target) -> dict:
    return {k: v.detach().clone() for k, v in target.model.state_dict().items()}


class _Payload:
    """Unpickling this runs a shell command that creates `marker` (what a malicious checkpoint would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant(folder, marker) -> list[str]:
    names = ["custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin", "scheduler.bin", "sampler.bin",
             "optimizer.pt"]
    for n in names:
        torch.save({"state": _Payload(marker)}, folder / n)
    return names


def test_resume_never_unpickles_a_crafted_checkpoint(tiny, tmp_path):
    over = ["train.max_steps=4", "train.save_every=2", "eval.every_steps=0", "eval.at_start=false"]
    r = make_recipe(tmp_path / "run", *over)
    head, frozen = make_head(r, tiny), target_state(tiny)
    init = state(head)
    Trainer(r, tiny, head, token_samples(8), None).train(stop_after=2)
    assert_trained(init, head, frozen, tiny)
    at_2 = state(head)
    ck = list_checkpoints(tmp_path / "run")[-1]
    marker = tmp_path / "pwned"
    _plant(ck, marker)
    resumed = make_head(r, tiny)
    res = Trainer(r, tiny, resumed, token_samples(8), None).train(resume=True)
    assert not marker.exists(), "resume ran code from a pickle in the checkpoint"
    assert res.steps == 4
    assert_trained(at_2, resumed, frozen, tiny)  # steps 3-4 moved the weights restored from step 2
    # a checkpoint holding only accelerate's pickles (no state of ours) is refused, naming the folder
    for p in ck.iterdir():
        if p.suffix in (".safetensors", ".json"):
            p.unlink()
    (ck / "trainer_state.json").write_text(json.dumps({"step": 2, "best_metric": None, "best_step": None,
                                                       "history": [], "num_processes": 1}))
    r2 = make_recipe(tmp_path / "run", *over, "train.max_steps=6")
    with pytest.raises(SpecheadsError, match=rf"{ck.name}.*(older|pickle)"):
        # the newest checkpoint (step 4) is fine: remove it so that the planted one is the newest
        import shutil

        shutil.rmtree(list_checkpoints(tmp_path / "run")[-1])
        Trainer(r2, tiny, make_head(r2, tiny), token_samples(8), None).train(resume=True)
    assert not marker.exists()


class _Killed(RuntimeError):
    pass


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_resume_bit_identical_with_noise_across_two_stops_and_a_kill_mid_save(tiny, tmp_path, monkeypatch, kind):
    """Default feature noise (train.noise=0.2) on. 12 samples, batch 2, grad accum 1: 6 steps per epoch, 24 steps =
    4 epochs; checkpoints every 3 steps. Stopped after 6, resumed and stopped after 15, resumed and killed inside
    the save at step 18 (a half-written .step-000018.tmp left), a stale .step-000021.tmp planted, resumed to the
    end: the weights equal the uninterrupted run's exactly."""
    import specheads.train.checkpoint as ckpt

    extra = ["head.draft_vocab_size=64", "head.ttt_steps=2"] if kind == "eagle3" else ["eval.eagle_steps=2"]
    over = [f"head.kind={kind}", "train.max_steps=24", "train.save_every=3", "eval.every_steps=5",
            "eval.max_samples=2", *extra]
    data, val = token_samples(12), token_samples(2, seed=1)
    a = make_recipe(tmp_path / "a", *over)
    assert a.train.noise == 0.2
    head_a, frozen = make_head(a, tiny), target_state(tiny)
    init = state(head_a)
    Trainer(a, tiny, head_a, data, val).train()
    assert_trained(init, head_a, frozen, tiny)  # else equal weights below would prove nothing

    b = make_recipe(tmp_path / "b", *over)

    def fresh_head():
        torch.manual_seed(123)  # a fresh process: other RNG state, other initial head (restored from the checkpoint)
        h = make_head(b, tiny)
        with torch.no_grad():
            for p in h.parameters():
                p.add_(1.0)
        return h

    assert Trainer(b, tiny, make_head(b, tiny), data, val).train(stop_after=6).steps == 6
    torch.rand(7)  # the global RNG moves on between processes
    assert Trainer(b, tiny, fresh_head(), data, val).train(resume=True, stop_after=15).steps == 15

    real = ckpt.write_optimizer_state

    def dies_at_18(opt, folder, *a, **k):
        if folder.name == ".step-000018.tmp":
            (folder / "optimizer.safetensors").write_bytes(b"half")
            raise _Killed("killed inside the save")
        return real(opt, folder, *a, **k)

    monkeypatch.setattr(ckpt, "write_optimizer_state", dies_at_18)
    with pytest.raises(_Killed):
        Trainer(b, tiny, fresh_head(), data, val).train(resume=True)
    monkeypatch.setattr(ckpt, "write_optimizer_state", real)
    assert (tmp_path / "b" / "checkpoints" / ".step-000018.tmp").exists()
    assert list_checkpoints(tmp_path / "b")[-1].name == "step-000015"
    stale = tmp_path / "b" / "checkpoints" / ".step-000021.tmp"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"junk")
    head_b = fresh_head()
    res = Trainer(b, tiny, head_b, data, val).train(resume=True)
    assert res.steps == 24
    sa, sb = state(head_a), state(head_b)
    diff = max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)
    assert diff == 0.0, f"resumed run differs from the uninterrupted one by {diff}"
    assert not list((tmp_path / "b" / "checkpoints").glob(".*tmp*"))
    summ_a = json.loads((tmp_path / "a" / "train_summary.json").read_text())
    summ_b = json.loads((tmp_path / "b" / "train_summary.json").read_text())
    assert summ_b["history"] == summ_a["history"] and summ_b["last_loss"] == summ_a["last_loss"]
    assert summ_a["last_loss"] > 0


def test_resume_of_a_finished_run_keeps_summary_true(tiny, tmp_path):
    """Resuming a run that already ended (killed after its last checkpoint): no second final evaluation in the
    history, and the last loss is the one stored in the checkpoint, not null."""
    r = make_recipe(tmp_path, "train.max_steps=4", "train.save_every=2")
    head, frozen = make_head(r, tiny), target_state(tiny)
    init = state(head)
    Trainer(r, tiny, head, token_samples(8), token_samples(2, seed=1)).train()
    assert_trained(init, head, frozen, tiny)
    first = json.loads((tmp_path / "train_summary.json").read_text())
    res = Trainer(r, tiny, make_head(r, tiny), token_samples(8), token_samples(2, seed=1)).train(resume=True)
    again = json.loads((tmp_path / "train_summary.json").read_text())
    steps = [h["step"] for h in again["history"]]
    assert steps == sorted(set(steps)) == [0, 2, 4]
    assert again["last_loss"] is not None and again["last_loss"] == first["last_loss"]
    assert res.last_loss == first["last_loss"]


class _SignalAt:
    """A collate that sends `signum` to this process while building micro-batch `at` (a kill from outside, landing
    in the middle of a step)."""

    def __init__(self, signum: int, at: int):
        from specheads.train.dataset import collate

        self.signum, self.at, self.calls, self.collate = signum, at, 0, collate

    def __call__(self, rows):
        self.calls += 1
        if self.calls == self.at:
            os.kill(os.getpid(), self.signum)
        return self.collate(rows)


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_mid_run_saves_that_step_releases_and_resumes_bit_for_bit(tiny, tmp_path, signame):
    """issue 38: SIGTERM during train ended the process without a save, a message or releasing the lock. SIGTERM
    and SIGINT now finish the step in progress, save it, and raise Interrupted naming the checkpoint and the command
    that continues it; that resume ends with the weights of an uninterrupted run."""
    import signal

    from specheads.utils import Interrupted

    signum = getattr(signal, signame)
    over = ["train.max_steps=8", "train.save_every=4", "eval.every_steps=0", "eval.at_start=false"]
    data = token_samples(16)
    a = make_recipe(tmp_path / "a", *over)
    head_a = make_head(a, tiny)
    Trainer(a, tiny, head_a, data, None).train()
    b = make_recipe(tmp_path / "b", *over)
    # the handlers the process had before (a background job starts with SIGINT ignored: `nohup make test &`; the
    # run then leaves SIGINT ignored, as a background job's Ctrl-C must be: Python's own handler, as a foreground
    # process has it, for this run)
    started = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        with pytest.raises(Interrupted) as e:  # accelerate's loader builds batch 6 ahead, while step 5 runs
            Trainer(b, tiny, make_head(b, tiny), data, None, collate_fn=_SignalAt(signum, 6)).train()
        after = {s: signal.getsignal(s) for s in before}
    finally:
        signal.signal(signal.SIGINT, started)
    ck = tmp_path / "b" / "checkpoints" / "step-000005"
    assert e.value.signum == signum and e.value.detail == (
        f"stopped after step 5; checkpoint {ck} saved: continue with `specheads train --config "
        f"{tmp_path / 'b' / 'train_config.yaml'} --resume`")
    assert [p.name for p in list_checkpoints(tmp_path / "b")] == ["step-000004", "step-000005"]
    assert after == before  # restored as they were
    head_b = make_head(b, tiny)
    assert Trainer(b, tiny, head_b, data, None).train(resume=True).steps == 8
    sa, sb = state(head_a), state(head_b)
    assert all(torch.equal(sa[k], sb[k]) for k in sa), "the resumed run differs from the uninterrupted one"


def test_resume_of_a_finished_run_whose_best_was_removed_names_no_missing_folder(tiny, tmp_path):
    """issue 38: the summary named a best_dir that did not exist. best/ of the last step is written again (the
    weights in hand are those); of an earlier step it cannot be, and the summary names none."""
    import shutil

    from specheads.train.checkpoint import write_checksums

    r = make_recipe(tmp_path, "train.max_steps=4", "train.save_every=2")
    first = Trainer(r, tiny, make_head(r, tiny), token_samples(8), token_samples(2, seed=1)).train()
    assert first.best_dir == tmp_path / "best"
    for best_step in (4, 1):  # best at the last step (the weights in hand), then at a step not kept
        shutil.rmtree(tmp_path / "best")
        state_file = list_checkpoints(tmp_path)[-1] / "trainer_state.json"
        state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "best_step": best_step}))
        write_checksums(state_file.parent)
        res = Trainer(r, tiny, make_head(r, tiny), token_samples(8), token_samples(2, seed=1)).train(resume=True)
        summary = json.loads((tmp_path / "train_summary.json").read_text())
        if best_step == 4:
            assert res.best_dir == tmp_path / "best" and (tmp_path / "best" / "model.safetensors").exists()
        else:
            assert res.best_dir is None and not (tmp_path / "best").exists()
            (tmp_path / "best").mkdir()  # (nothing left to remove next round)
        assert summary["best_dir"] == (None if res.best_dir is None else str(res.best_dir))


def test_a_background_run_leaves_an_ignored_sigint_ignored():
    """issue 49: a background job (`nohup specheads train ... &`, a script's `&`) starts with SIGINT ignored, so
    that a Ctrl-C meant for the script's foreground leaves it alone; training takes SIGTERM only then, and gives
    every handler back as it was."""
    import signal

    from specheads.train.stopping import stop_requests

    started = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        term = signal.getsignal(signal.SIGTERM)
        with stop_requests() as stop:
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) != term
            signal.raise_signal(signal.SIGTERM)
            assert stop.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN and signal.getsignal(signal.SIGTERM) == term
    finally:
        signal.signal(signal.SIGINT, started)
