"""Regeneration runs on the engine's own plain decoding (train/regenerate.decode_answers): both paths (the one-row
loop, batch_size 1 or a sliding-window target; the batched loop, batch_size > 1) give HF generate's greedy answers
in fp32, without the end-of-sequence token and within each answer's cap; a sampled answer's seed gives the same
answer in every run and batch composition; a regeneration split over two calls writes what one call writes."""
from __future__ import annotations

import json

import pytest
import torch

from specheads.train.regenerate import decode_answers, decoding_path, one_row


def _prompts(n_tokens, seed, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in n_tokens]


def _hf_greedy(target, prompt, cap):
    """HF generate alone on the prompt, cut before its first end-of-sequence token."""
    if cap == 0:
        return []
    out = target.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=cap, do_sample=False, eos_token_id=target.eos_token_ids,
                                pad_token_id=0)[0, len(prompt):].tolist()
    stop = [i for i, t in enumerate(out) if t in target.eos_token_ids]
    return out[:stop[0]] if stop else out


@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_answers_equal_hf_generate_on_both_paths(tiny, batch_size):
    prompts = _prompts((3, 9, 5, 4, 6, 2, 8), seed=0)
    caps = [6, 2, 9, 1, 0, 7, 5]
    free = _hf_greedy(tiny, prompts[2], 9)  # make one of its tokens the end token: that answer stops before it
    tiny.model.generation_config.eos_token_id = free[4]
    assert free[4] in tiny.eos_token_ids
    work = [(f"k{i}", p, c, i) for i, (p, c) in enumerate(zip(prompts, caps))]
    got = dict(decode_answers(tiny, work, batch_size))
    assert one_row(tiny, batch_size) == (batch_size == 1)
    assert ("one-row" if batch_size == 1 else "batched loop, 3 rows") in decoding_path(tiny, batch_size)
    assert sorted(got) == sorted(k for k, *_ in work)
    assert got["k2"] == free[:free.index(free[4])]  # stopped, the end token dropped
    for key, p, cap, _ in work:
        assert got[key] == _hf_greedy(tiny, p, cap), key
        assert len(got[key]) <= cap


def test_sliding_window_target_runs_the_one_row_loop(sliding):
    """Sliding-window layers cannot share the batched loop's columns: batch_size 3 decodes row by row, exactly."""
    assert one_row(sliding, 3) and "sliding-window" in decoding_path(sliding, 3)
    prompts = _prompts((12, 5, 10), seed=1)
    got = dict(decode_answers(sliding, [(i, p, 10, 0) for i, p in enumerate(prompts)], batch_size=3))
    for i, p in enumerate(prompts):
        assert got[i] == _hf_greedy(sliding, p, 10), i


def test_a_sampled_answer_depends_on_its_seed_not_on_its_batch(tiny):
    prompts = _prompts((4, 7, 3, 6, 5), seed=2)
    work = [(i, p, 12, 1000 + i) for i, p in enumerate(prompts)]

    def sample(items, batch_size):
        return dict(decode_answers(tiny, items, batch_size, temperature=1.0, top_p=0.9))

    ref = sample(work, 2)
    assert sample(work, 2) == ref  # the same run again
    assert sample(work, 5) == ref  # other rows beside each answer
    assert sample(work[3:] + work[:1], 2) == {k: ref[k] for k in (3, 4, 0)}  # other batch compositions
    assert sample(work, 1) == ref  # the one-row loop (the owned forward) draws the same
    reseeded = sample([(i, p, c, s + 1) for i, p, c, s in work], 2)
    assert reseeded != ref  # the seed is what decides
    assert ref != dict(decode_answers(tiny, work, 2))  # and it did sample (not the greedy answers)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regeneration_over_two_calls_writes_what_one_call_writes(tmp_path, smol_tokenizer, temperature):
    """A run stopped after 3 conversations and rerun (another batch_size) ends as one run: same bytes, source's
    order; multi-turn conversations (c0, c3) answered turn by turn."""
    from specheads.target import tiny_target
    from specheads.conversations.load import load_conversations
    from specheads.train.regenerate import regenerate

    target = tiny_target(vocab_size=len(smol_tokenizer), tokenizer=smol_tokenizer)
    rows = []
    for i in range(6):
        turns = [{"from": "human", "value": f"Question {i}: " + "why? " * i}, {"from": "gpt", "value": "A."}]
        if i % 3 == 0:
            turns += [{"from": "human", "value": "More?"}, {"from": "gpt", "value": "B."}]
        rows.append({"id": f"c{i}", "conversations": turns})
    src = tmp_path / "convs.json"
    src.write_text(json.dumps(rows))
    convs, _ = load_conversations(str(src))
    kw = dict(max_length=96, max_new_tokens=5, temperature=temperature, seed=3, progress=False)
    one, split = tmp_path / "one.jsonl", tmp_path / "split.jsonl"
    regenerate(target, convs, one, batch_size=4, **kw)
    regenerate(target, convs.select([4, 0, 2]), split, batch_size=1, **kw)
    s = regenerate(target, convs, split, batch_size=2, **kw)
    assert s["already_done"] == 3 and s["regenerated"] == 3
    assert split.read_text() == one.read_text()
    lines = [json.loads(x) for x in one.read_text().splitlines()]
    assert [x["id"] for x in lines] == [f"c{i}" for i in range(6)]
    for x in lines:
        answers = [m for m in x["messages"] if m["role"] == "assistant"]
        assert len(answers) == (2 if x["id"] in ("c0", "c3") else 1)
        assert all(1 <= len(m["token_ids"]) <= 5 for m in answers)
