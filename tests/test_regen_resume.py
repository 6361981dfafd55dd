"""Regeneration killed at any point and resumed ends byte for byte as one uninterrupted run (issue 49): answers,
their order and their token ids, for every data.regen_batch_size (1: the one-row loop; 2, 3 and one larger than
the number of conversations: the batched loop), greedy and sampled (seeded). The interruption is injected in the
process after k answers (Ctrl-C landing between two answers, including in the middle of a batch's answers, some
of its conversations written and some not), with and without a torn last line (a kill mid-write), and once as a
real SIGKILL of a process held in the output's fsync."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specheads.train import regenerate as regen

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

import reliability_kill as kill9  # noqa: E402

N_CONVS = 7
KW = dict(max_length=96, max_new_tokens=6, seed=5, progress=False)


def _rows(n: int = N_CONVS) -> list[dict]:
    """Conversations of several lengths (the batch sorts them), every third one with a second turn (a wave)."""
    rows = []
    for i in range(n):
        turns = [{"from": "human", "value": f"Question {i}: " + "why? " * (i % 4)}, {"from": "gpt", "value": "A."}]
        if i % 3 == 0:
            turns += [{"from": "human", "value": "And then?"}, {"from": "gpt", "value": "B."}]
        rows.append({"id": f"c{i}", "conversations": turns})
    return rows


@pytest.fixture(scope="module")
def setup(smol_tokenizer, tmp_path_factory):
    from specheads.target import tiny_target
    from specheads.conversations.load import load_conversations

    src = tmp_path_factory.mktemp("regen") / "convs.json"
    src.write_text(json.dumps(_rows()))
    convs, _ = load_conversations(str(src))
    return tiny_target(vocab_size=len(smol_tokenizer), tokenizer=smol_tokenizer), convs, src


def _stop_after(k: int):
    """_Answers.answered that raises KeyboardInterrupt (a Ctrl-C landing there) before answer number k+1."""
    inner, calls = regen._Answers.answered, [0]

    def answered(answers, j, answer, work):
        if calls[0] == k:
            raise KeyboardInterrupt
        calls[0] += 1
        return inner(answers, j, answer, work)
    return answered


def _answers_in(path: Path) -> int:
    return sum(m["role"] == "assistant" for ln in path.read_text().splitlines() for m in json.loads(ln)["messages"])


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("batch_size", [1, 2, 3, N_CONVS + 2])
def test_interrupted_after_k_answers_and_resumed_equals_one_run(setup, tmp_path, monkeypatch, batch_size,
                                                                temperature):
    target, convs, _ = setup
    ref = tmp_path / "ref.jsonl"
    whole = regen.regenerate(target, convs, ref, batch_size=batch_size, temperature=temperature, **KW)
    total = _answers_in(ref)
    assert whole["regenerated"] == N_CONVS and total > N_CONVS  # the second turns were answered too
    for k in (0, 1, 4, total - 1):
        for torn in (False, True):
            got = tmp_path / f"k{k}-{torn}.jsonl"
            monkeypatch.setattr(regen._Answers, "answered", _stop_after(k))
            with pytest.raises(KeyboardInterrupt):
                regen.regenerate(target, convs, got, batch_size=batch_size, temperature=temperature, **KW)
            monkeypatch.undo()
            kept = got.read_text() if got.exists() else ""
            assert all(json.loads(ln)["id"] for ln in kept.splitlines())  # whole lines only
            if torn and kept:  # a kill in the middle of writing its last line: half of it is on disk
                last = kept.splitlines()[-1]
                got.write_text(kept[:len(kept) - len(last) - 1 + len(last) // 2])
            s = regen.regenerate(target, convs, got, batch_size=batch_size, temperature=temperature, **KW)
            assert got.read_bytes() == ref.read_bytes(), (k, torn)
            assert s["already_done"] + s["regenerated"] == N_CONVS
    # stopped after its last answer was appended, before the file was put in the source's order: the rerun has
    # nothing to answer and still leaves one run's order (it left the batch's, in which the tokens were trained)
    got = tmp_path / "last.jsonl"

    def stop(path, ids):
        raise KeyboardInterrupt
    monkeypatch.setattr(regen, "canonical_order", stop)
    with pytest.raises(KeyboardInterrupt):
        regen.regenerate(target, convs, got, batch_size=batch_size, temperature=temperature, **KW)
    monkeypatch.undo()
    assert sorted(got.read_text().splitlines()) == sorted(ref.read_text().splitlines())
    assert regen.regenerate(target, convs, got, batch_size=batch_size, temperature=temperature, **KW)[
        "regenerated"] == 0
    assert got.read_bytes() == ref.read_bytes()


def test_batch_sizes_agree_on_the_greedy_answers(setup, tmp_path):
    """The batched loop in fp32 writes the one-row loop's greedy answers, whatever the rows beside them."""
    target, convs, _ = setup
    files = []
    for b in (1, 2, 3, N_CONVS + 2):
        files.append(tmp_path / f"b{b}.jsonl")
        regen.regenerate(target, convs, files[-1], batch_size=b, temperature=0.0, **KW)
    assert len({f.read_bytes() for f in files}) == 1


SCRIPT = """import sys
import torch
torch.set_num_threads(1)
from transformers import AutoTokenizer
from specheads.target import tiny_target
from specheads.conversations.load import load_conversations
from specheads.train.regenerate import regenerate
tok = AutoTokenizer.from_pretrained(sys.argv[1])
convs, _ = load_conversations(sys.argv[2])
regenerate(tiny_target(vocab_size=len(tok), tokenizer=tok), convs, sys.argv[3], batch_size=3, temperature=1.0,
           max_length=96, max_new_tokens=6, seed=5, progress=False)
"""


@pytest.mark.slow
def test_a_sigkilled_batched_regeneration_resumes_to_the_same_bytes(setup, smol_tokenizer, tmp_path):
    """A real SIGKILL of a process held in the output's first fsync (3 conversations written and flushed), then a
    rerun in another process: the file equals an uninterrupted process's, byte for byte (sampled, batch 3)."""
    _, _, src = setup
    smol_tokenizer.save_pretrained(tmp_path / "tok")
    (tmp_path / "regen.py").write_text(SCRIPT)
    env = kill9._env(tmp_path, None)

    def argv(out: Path) -> list[str]:
        return [sys.executable, str(tmp_path / "regen.py"), str(tmp_path / "tok"), str(src), str(out)]

    ref = subprocess.run(argv(tmp_path / "ref.jsonl"), env=env, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-2000:]
    got = tmp_path / "got.jsonl"
    p = subprocess.Popen(argv(got), env=kill9._env(tmp_path, "/got.jsonl"), stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    t = time.monotonic()
    while not (got.exists() and got.stat().st_size > 0):  # flushed, now in the fsync that never returns
        assert p.poll() is None, p.stderr.read()[-2000:]
        assert time.monotonic() - t < 300
        time.sleep(0.002)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert 0 < len(got.read_text().splitlines()) < N_CONVS
    again = subprocess.run(argv(got), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert got.read_bytes() == (tmp_path / "ref.jsonl").read_bytes()
