"""Self-speculative decoding (drafters/self_spec.py, scheduling/skipsearch.py, OwnedLlama.draft): the draft pass over
the shared cache, greedy output identical to HF generate with the layer-skip draft alone and with lookup, lossless
sampling, the skip-set search and its cache, and one clear line where the draft cannot run."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from specheads.infer.drafters import LayerSkipDrafter, build_drafter
from specheads.infer.engine.generate import SpeculativeGenerator, generate
from specheads.infer.engine.owned import SkipSet
from specheads.infer.engine.runner import runner_for
from specheads.infer.scheduling import skipsearch
from specheads.infer.scheduling.step import Scheduler
from specheads.infer.verify import SamplingParams, target_probs
from specheads.target import tiny_gemma3_target, tiny_target
from specheads.utils import SpecheadsError
from test_generate import hf_greedy, prompts
from test_sampling_stats import assert_same

pytestmark = pytest.mark.usefixtures("one_thread")

FLAT = {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2, 32: 1.4}  # a cost profile t(n)/t(1) as flat as a CPU's


def sched():
    return Scheduler(FLAT, 1e-3)  # hand-made: nothing measured, no cache written


def prefilled(target, ids):
    m = runner_for(target).model
    m.reset(4)  # small: draft passes grow it
    m.forward(torch.tensor(ids), torch.arange(len(ids)), None, logit_rows="none")
    m.keep(len(ids), list(range(len(ids))))
    return m


def test_skip_set_text_round_trip_and_one_line_errors():
    s = SkipSet.parse("m4-6, a9,2,20-21", 30)
    assert s.attn == {2, 9, 20, 21} and s.mlp == {2, 4, 5, 6, 20, 21} and len(s) == 10
    assert s.text() == "2,20-21,a9,m4-6" and SkipSet.parse(s.text(), 30) == s
    assert SkipSet.parse("none", 4) == SkipSet() and SkipSet().text() == "none"
    assert s.units(3) == ((0, True), (0, False), (1, True), (1, False))  # layer 2 skipped whole
    for bad, why in (("x3", "is not I, aI, mI"), ("30", "outside the target's layers 0..29"), ("5-2", "outside"),
                     ("0-29", "skips every sublayer")):
        with pytest.raises(SpecheadsError, match=f"--skip-layers {bad}: .*{why}"):
            SkipSet.parse(bad, 30)


def test_draft_pass_reads_the_kept_cache_and_writes_only_beyond_it(tiny):
    prompt = [5, 9, 17, 33, 2, 71, 8]
    m = prefilled(tiny, prompt)
    kept = m.snapshot()
    full = m.forward(torch.tensor([40]), torch.tensor([7]), None)[0][0]
    torch.testing.assert_close(m.draft(torch.tensor([40]), 0, SkipSet()), full)  # nothing skipped: the target
    skip = SkipSet.parse("1-2", 4)
    chain = [m.draft(torch.tensor([x]), j, skip) for j, x in enumerate([40, 41, 42])]  # one pass per token
    torch.testing.assert_close(m.draft(torch.tensor([40, 41, 42]), 0, skip), chain[-1])  # = one pass of three
    assert m.length == len(prompt)
    torch.testing.assert_close(m.k[:, :, :m.length], kept[0])  # the kept prefix is never written by a draft
    torch.testing.assert_close(m.v[:, :, :m.length], kept[1])
    # a draft with no cached prefix is the target with those layers removed (HF's forward)
    short = copy.deepcopy(tiny.model)
    short.model.layers = torch.nn.ModuleList([short.model.layers[0], short.model.layers[3]])
    for i, layer in enumerate(short.model.layers):
        layer.self_attn.layer_idx = i
    short.config.num_hidden_layers = 2
    m.reset(4)
    torch.testing.assert_close(m.draft(torch.tensor(prompt), 0, skip), short(torch.tensor([prompt])).logits[0, -1])
    # the search reads a shorter prefix of a cached sequence: the same as a cache holding only that prefix
    m = prefilled(tiny, prompt)
    a = m.draft(torch.tensor([33]), 0, skip, prefix=3)
    m = prefilled(tiny, prompt[:3])
    torch.testing.assert_close(a, m.draft(torch.tensor([33]), 0, skip))


def layer_skip_drafters(target):
    return {
        "chain": build_drafter(target, "layer-skip", "3", skip="m1-2"),
        "auto": build_drafter(target, "layer-skip", "auto", skip="a2,m1", scheduler=sched()),
        "none-skipped": build_drafter(target, "layer-skip", "4", skip="none"),
        "+lookup": build_drafter(target, "layer-skip", "auto", skip="2", lookup=4, lookup_ngram=2,
                                 scheduler=sched()),
    }


def test_greedy_identical_to_hf_generate_alone_and_with_lookup(tiny):
    ps = prompts(tiny.vocab_size, 4)
    refs = [hf_greedy(tiny, p, 24) for p in ps]
    for name, d in layer_skip_drafters(tiny).items():
        for p, ref in zip(ps, refs):
            r = generate(tiny, d, p, max_new_tokens=24)
            assert r.ids == ref, name
            assert sum(n * c for n, c in enumerate(r.stats.accept_hist)) == len(ref)
        if name == "none-skipped":  # the draft is the target itself: every chain accepted
            assert r.stats.tau > 4.0, r.stats
    d = layer_skip_drafters(tiny)["auto"]
    generate(tiny, d, ps[0], max_new_tokens=16)
    assert d.rates.seen and d.first.seen  # greedy outcomes calibrate the confidences


def test_adaptive_exit_drafts_long_chains_of_a_good_draft_and_rests_a_bad_one(tiny):
    good = build_drafter(tiny, "layer-skip", "auto", skip="m0-3", scheduler=sched())  # reads 40% of the weights
    hists = [generate(tiny, good, p, max_new_tokens=40, ignore_eos=True).stats.accept_hist
             for p in prompts(tiny.vocab_size, 5, seed=1)]
    assert len(hists[0]) <= 3 < len(hists[-1])  # calibrated over the requests: chains of 3+ drafts accepted whole
    one = build_drafter(tiny, "layer-skip", "auto", skip="none", scheduler=sched())  # the target itself: a pass
    r = generate(tiny, one, prompts(tiny.vocab_size, 1)[0], max_new_tokens=40, ignore_eos=True)  # costs a forward
    assert r.stats.tau < 1.5  # so drafting never pays: it rests
    bad = LayerSkipDrafter(tiny, SkipSet.parse("0-2", 4), scheduler=sched(),
                           record={"acceptance": [0.0], "seen": [100]})  # measured to miss: one draft never pays
    r = generate(tiny, bad, prompts(tiny.vocab_size, 1)[0], max_new_tokens=40, ignore_eos=True)
    assert r.stats.tree_nodes <= r.stats.target_forwards + 3 * bad.MAX_AUTO  # rested but for the explorations


def test_sampling_is_lossless():
    """generate() with the layer-skip draft (q rows = the skipped pass's warped distributions) on an 8-token
    vocabulary: the first two new tokens against the exact target distribution, chi-square."""
    V = 8
    target = tiny_target(vocab_size=V, hidden_size=32, num_layers=2, seed=0)
    prompt = [1, 5, 3]
    sampling = SamplingParams(temperature=1.0, top_k=4)
    with torch.no_grad():
        p1 = target_probs(target.model(torch.tensor([prompt])).logits[0, -1:], sampling)[0]
        p2 = target_probs(target.model(torch.tensor([prompt + [x] for x in range(V)])).logits[:, -1], sampling)
    expected = (p1[:, None] * p2).flatten()
    n = 600
    counts = torch.zeros(V * V)
    for name, d in (("chain", build_drafter(target, "layer-skip", "2", skip="m1")),
                    ("auto", build_drafter(target, "layer-skip", "auto", skip="a0", scheduler=sched()))):
        counts.zero_()
        gen = SpeculativeGenerator(target, d)
        for s in range(n):
            out = list(gen.stream(prompt, max_new_tokens=2, temperature=1.0, top_k=4, seed=s, ignore_eos=True))
            ids = [x for chunk in out for x in chunk]
            counts[ids[0] * V + ids[1]] += 1
        assert gen.result.stats.tree_nodes > gen.result.stats.target_forwards, name  # it drafted
        assert_same(counts, expected * n)


def test_search_returns_a_valid_set_and_caches_it(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    calib = prompts(tiny.vocab_size, 2)
    rec = skipsearch.load_or_search(tiny, calib, tokens=12, budget=5)
    skip = SkipSet.parse(rec["skip"], tiny.num_layers)
    assert 1 <= len(skip) < 2 * tiny.num_layers and not rec["cached"]
    assert len(rec["evaluations"]) <= 5 and rec["value"] == max(e["value"] for e in rec["evaluations"])
    assert len(rec["acceptance"]) == skipsearch.WALK_DEPTH and 0 < rec["share"] < 1
    assert rec["pays"] == (rec["value"] > 1.0) and rec["prompts"] == 2
    on_disk = json.loads(open(rec["path"]).read())
    assert on_disk["skip"] == rec["skip"] and "profiles" in rec["path"] and "layerskip" in rec["path"]

    def no_search(*a, **k):
        raise AssertionError("searched again")

    monkeypatch.setattr(skipsearch, "search", no_search)
    again = skipsearch.load_or_search(tiny, calib)
    assert again["cached"] and again["skip"] == rec["skip"]
    d = build_drafter(tiny, "layer-skip", "3", calib_ids=calib)  # --skip-layers auto: the cached set
    assert d.skip == skip and d.record["from"] == "search"
    ps = prompts(tiny.vocab_size, 2, seed=3)
    assert [generate(tiny, d, p, max_new_tokens=12).ids for p in ps] == [hf_greedy(tiny, p, 12) for p in ps]


def test_one_clear_line_where_the_draft_cannot_run(tiny):
    gemma = tiny_gemma3_target()
    with pytest.raises(SpecheadsError, match=r"--drafter layer-skip: target tiny-gemma3-0 runs the HF forward "
                                             r"\(model_type 'gemma3_text' is not one of the owned families"):
        build_drafter(gemma, "layer-skip", skip="1")
    tiny.engine = "hf"
    with pytest.raises(SpecheadsError, match=r"runs the HF forward \(--engine hf\); .* \(--engine auto or owned"):
        build_drafter(tiny, "layer-skip", "3", skip="1")
    tiny.engine = "auto"
    with pytest.raises(SpecheadsError, match="--skip-layers auto: target tiny-llama-0 has no tokenizer"):
        build_drafter(tiny, "layer-skip", "3")
    from specheads.infer.bench.names import check_batch_methods, check_method_names
    from specheads.infer.engine.batch import generate_batch

    check_method_names(["layer-skip", "layer-skip+lookup", "combo+layer-skip"])
    with pytest.raises(SpecheadsError, match="layer-skip with --batch-sizes: a layer-skip draft shares"):
        check_batch_methods(["plain", "layer-skip"])
    with pytest.raises(SpecheadsError, match="drafts over the single-request loop's own cache"):
        generate_batch(tiny, lambda: build_drafter(tiny, "layer-skip", "2", skip="1"),
                       prompts(tiny.vocab_size, 2), max_new_tokens=4)


def test_bench_methods_on_the_tiny_target(tiny, tmp_path, monkeypatch):
    from specheads.infer import resolve
    from specheads.infer.bench import BenchSettings, MethodOptions, build_methods, run_bench
    from specheads.prompts import BenchPrompt
    from test_bench import ByteTok

    tiny.tokenizer = ByteTok()
    monkeypatch.setattr(resolve, "load_or_profile", lambda target, refresh=False: {
        "verify": {"relative": {str(k): v for k, v in FLAT.items()}, "seconds": {"1": 1e-3}}})
    prompts_ = [BenchPrompt(id=str(i), category=c, turns=[t], chat=False)
                for i, (c, t) in enumerate([("a", "abc abc abc abc"), ("b", "hello hello hello")])]
    methods, extra = build_methods(["layer-skip", "layer-skip+lookup"], tiny, MethodOptions(skip_layers="m1-2"))
    assert [m.name for m in methods] == ["vanilla", "layer-skip", "layer-skip+lookup"]
    assert "the target skipping m1-2 (2 of 8 sublayers" in extra["trees"]["layer-skip"]["summary"]
    settings = BenchSettings(target="tiny", dataset="inline", dtype="float32", max_new_tokens=8, warmup_tokens=2)
    res = run_bench(prompts_, methods, settings, tiny.tokenizer, out_dir=tmp_path, extra=extra, progress=False)
    for name in ("layer-skip", "layer-skip+lookup"):
        assert res["methods"][name]["overall"]["identical"] == 1.0, name


def test_cli_generate_with_the_layer_skip_drafter(tiny, capsys, monkeypatch):
    """`specheads generate --drafter layer-skip`: --skip-layers checked against the target, --tree auto and --lookup
    taken without a head, the scheduler's figures reported."""
    import specheads.infer.drafters.build as drafters_mod
    import specheads.target
    from specheads.cli import main
    from test_bench import ByteTok

    tiny.tokenizer = ByteTok()
    monkeypatch.setattr(specheads.target, "load_target", lambda *a, **k: tiny)
    monkeypatch.setattr(drafters_mod.Scheduler, "for_target",
                        classmethod(lambda cls, target, refresh=False, pricing="measured":
                                    Scheduler(FLAT, 1e-3, pricing=pricing)))
    base = ["generate", "--drafter", "layer-skip", "--prompt", "abc abc abc", "--raw", "--json", "--max-new-tokens", "8"]
    assert main(base + ["--skip-layers", "m7"]) == 2
    assert "--skip-layers m7: 'm7' is outside the target's layers 0..3" in capsys.readouterr().err
    for extra in (["--skip-layers", "m1-2"], ["--skip-layers", "a1", "--lookup", "4"], ["--skip-layers", "1", "--tree", "3"]):
        assert main(base + extra) == 0, extra
        out = json.loads(capsys.readouterr().out)
        assert out["ids"] == hf_greedy(tiny, [1] + [3 + b % 250 for b in b"abc abc abc"], 8)[:len(out["ids"])]
        assert bool(out["stats"]["scheduled_steps"]) == ("--tree" not in extra)
