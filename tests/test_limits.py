"""Limits met mid-run (issue 49, point 3): the target's context window, trees over the engine's CUDA-graph buckets,
a huge --max-new-tokens and a cache that cannot grow. Each is refused up front or handled: generation stops at the
window with stop reason "context_window", its output equal to plain greedy decoding to the same length, and no
position at or past the window is ever written (single and batched paths, an EAGLE-3 tree, prompt lookup and a
block drafter; the bench's HF methods cut where ours stop). fp32 tiny target: its window is 512 positions."""
import pytest
import torch
from helpers import make_head

from specheads.infer.bench.batch import HFBatch
from specheads.infer.bench.methods import HFGenerate, OursGenerate, window_cap
from specheads.infer.drafters import build_drafter
from specheads.infer.engine.batch import generate_batch
from specheads.infer.engine.generate import INITIAL_ROOM, generate
from specheads.infer.engine.graphs import BUCKETS, GraphedOwned
from specheads.infer.engine.runner import OwnedRunner, runner_for
from specheads.prompts import BenchPrompt, check_later_turns
from specheads.utils import SpecheadsError

pytestmark = pytest.mark.usefixtures("one_thread")


def greedy(target, prompt, n):
    """Plain greedy decoding by HF generate, no stop token: the reference every path must equal."""
    out = target.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                                eos_token_id=None)
    return out[0, len(prompt):].tolist()


def random_prompt(length, seed=0):
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def makers(tiny):
    """An EAGLE-3 tree (48 nodes, deeper than the room left near the end), prompt lookup and a DSpark block."""
    eagle3, dspark = make_head(tiny, "eagle3"), make_head(tiny, "dspark")
    return {"eagle3": lambda: build_drafter(tiny, eagle3, "5,8,48"),
            "prompt-lookup": lambda: build_drafter(tiny, "prompt-lookup", "8"),
            "dspark": lambda: build_drafter(tiny, dspark, "chain:4")}


def record_positions(runner):
    """Wrap the runner's forward: every position a forward writes, in a list."""
    seen, forward = [], runner.forward

    def spy(tokens, plan=None, layers=None, logit_rows="all"):
        start = runner.length
        seen.extend((plan[0].tolist() if plan is not None else range(start, start + tokens.numel())))
        return forward(tokens, plan, layers, logit_rows)

    runner.forward = spy
    return seen


def test_single_path_stops_at_the_window_equal_to_greedy(tiny, makers):
    window = tiny.max_positions
    seen = record_positions(runner_for(tiny))
    for room in (1, 3, 30):
        p = random_prompt(window - room, seed=room)
        ref = greedy(tiny, p, room)
        for name, make in makers.items():
            for cap in (room + 5, 10 ** 9):  # over the window, and absurd
                seen.clear()
                r = generate(tiny, make(), p, max_new_tokens=cap, ignore_eos=True)
                assert r.ids == ref and r.stats.stop_reason == "context_window", (name, room, cap)
                assert max(seen) == window - 2, (name, room)  # the last root; the bonus token is never cached
            r = generate(tiny, make(), p, max_new_tokens=room, ignore_eos=True)  # the cap meets the window
            assert r.ids == ref and r.stats.stop_reason == "max_new_tokens", name


def test_a_huge_max_new_tokens_allocates_only_what_can_be_used(tiny, monkeypatch):
    p = random_prompt(20)
    r = generate(tiny, build_drafter(tiny, "prompt-lookup"), p, max_new_tokens=2 ** 62, ignore_eos=True)
    assert len(r.ids) == tiny.max_positions - 20 and r.stats.stop_reason == "context_window"
    model = runner_for(tiny).model
    assert model.k.shape[2] <= tiny.max_positions + 64  # the window's columns, not 2**62
    monkeypatch.setattr(type(tiny), "max_positions", property(lambda t: None))  # no known window: the cache
    # starts small and grows
    r = generate(tiny, build_drafter(tiny, "plain"), p, max_new_tokens=10 ** 12, eos_token_ids=[r.ids[3]])
    assert r.stats.stop_reason == "eos" and model.k.shape[2] <= 20 + INITIAL_ROOM + 64


def test_a_cache_that_cannot_grow_is_one_clear_error(tiny):
    model = OwnedRunner(tiny, compiled=False).model
    model.reset(8)
    with pytest.raises(SpecheadsError, match=r"KV cache cannot hold 1099511627776 columns .* lower --max-new-tokens"):
        model._grow(2 ** 40)


def test_the_static_graph_step_near_the_window(tiny):
    """GraphedOwned (the CUDA-graph step, eager on a CPU): trees inside and over the largest bucket, the cache's
    last columns reached; exact against greedy and never a position at the window."""
    runner = OwnedRunner(tiny, compiled=False)
    runner.graphed = GraphedOwned(runner.model)
    tiny._runner = (("auto", "auto"), runner)
    seen = record_positions(runner)
    head = make_head(tiny, "eagle3")
    window = tiny.max_positions
    for room, tree in ((2, "5,8,48"), (12, f"6,12,{BUCKETS[-1] + 36}")):  # 48 nodes: a bucket; 100: eager
        p = random_prompt(window - room, seed=room)
        seen.clear()
        r = generate(tiny, build_drafter(tiny, head, tree), p, max_new_tokens=10 ** 9, ignore_eos=True)
        assert r.ids == greedy(tiny, p, room) and r.stats.stop_reason == "context_window", tree
        assert max(seen) == window - 2
    assert runner.graphed.graphs and runner.model.k.shape[2] >= window  # the buckets ran and fit the cache


def test_batch_rows_of_different_lengths_each_stop_at_the_window(tiny, makers):
    window = tiny.max_positions
    ps = [random_prompt(window - 2, 1), random_prompt(10, 2), random_prompt(window - 9, 3), random_prompt(40, 4)]
    caps = [10 ** 9, 6, 10 ** 9, 12]
    refs = [greedy(tiny, p, min(c, window - len(p))) for p, c in zip(ps, caps)]
    for name, make in {"plain": None, **makers}.items():
        for size in (None, 2):  # all rows at once; two at a time (rows join as others finish)
            res = generate_batch(tiny, make, ps, caps, batch_size=size, ignore_eos=True)
            assert [r.ids for r in res.rows] == refs, (name, size)
            assert [r.stats.stop_reason for r in res.rows] == ["context_window", "max_new_tokens",
                                                                "context_window", "max_new_tokens"], (name, size)
    with pytest.raises(SpecheadsError, match=f"prompt 1: {window} tokens do not fit the context window of {window}"):
        generate_batch(tiny, None, [ps[1], random_prompt(window)], 4)


def test_bench_hf_methods_cut_where_ours_stop(tiny):
    """HF generate goes on past the window; the bench's vanilla (single and batched) cuts there, so its outputs
    still equal ours token for token and the records say why they stopped."""
    window = tiny.max_positions
    tiny.model.generation_config.eos_token_id = None
    p, short = random_prompt(window - 5, 1), random_prompt(30, 2)
    van = HFGenerate("vanilla", tiny, 0.0).generate(p, 50)
    ours = OursGenerate("plain", tiny, build_drafter(tiny, "plain"), 0.0, {}, ignore_eos=True).generate(p, 50)
    assert van.output_ids == ours.output_ids == greedy(tiny, p, 5)
    assert van.stop_reason == ours.stop_reason == "context_window"
    assert HFGenerate("vanilla", tiny, 0.0).generate(short, 4).stop_reason == "max_new_tokens"
    rows = HFBatch(tiny, 0.0).run([p, short], 20, seed=0)
    assert rows.outputs == [greedy(tiny, p, 5), greedy(tiny, short, 20)] and rows.at_window == 1
    assert window_cap(tiny, 100, 10 ** 9) == window - 100
    with pytest.raises(SpecheadsError, match=f"{window} tokens do not fit the context window of {window}"):
        window_cap(tiny, window, 4)


class Chars:
    """One token per character (plain completions: no chat template)."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [3 + ord(c) % 200 for c in text]}


def test_both_turns_that_cannot_fit_are_refused_before_the_run(tiny):
    tiny.tokenizer = Chars()
    prompts = [BenchPrompt("a", "c", ["x" * 10, "y" * 5], chat=False),
               BenchPrompt("b", "c", ["x" * 100, "y" * 300], chat=False)]
    check_later_turns(tiny, prompts[:1], "p.jsonl", 256)  # 10 + 256 + 5 fits 512
    with pytest.raises(SpecheadsError, match=r"prompt b turn 2: up to 656 tokens .* lower --max-new-tokens to 111"):
        check_later_turns(tiny, prompts, "p.jsonl", 256)
