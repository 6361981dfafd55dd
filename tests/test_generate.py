"""The speculative loop: greedy output identical to plain HF generate with every drafter; streaming; stops; bad input."""
import copy
import json

import pytest
import torch

from specheads.heads.base import HeadSpec, build_head, load_head
from specheads.infer.drafters import (DraftContext, Drafter, DraftModelDrafter, DSparkDrafter, EagleDrafter,
                                      MedusaDrafter, NoDrafter, PEagleDrafter, PromptLookupDrafter,
                                      TokenRecyclingDrafter, build_drafter, combine_drafters, truncated_draft_model)
from specheads.infer.engine.generate import SpeculativeGenerator, generate
from specheads.infer.tree import DraftTree
from specheads.target import tiny_target
from specheads.utils import SpecheadsError

# Small sequential forwards: one intra-op thread is several times faster than two on a shared CPU.
pytestmark = pytest.mark.usefixtures("one_thread")



class OracleTreeDrafter(Drafter):
    """Test drafter: knows the target's greedy continuation and hides it among wrong siblings at random child
    positions, stopping at a random depth, so accepted paths skip rejected siblings in the middle of the cache."""
    name = "oracle-tree"

    def __init__(self, model, depth=4, seed=0):
        self.model, self.depth, self.g = model, depth, torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        ids, good = list(ctx.ids), []
        for _ in range(min(self.depth, ctx.max_depth)):
            nxt = int(self.model(torch.tensor([ids])).logits[0, -1].argmax())
            good.append(nxt)
            ids.append(nxt)
        cut = int(torch.randint(0, len(good) + 1, (), generator=self.g))  # correct up to depth `cut`
        tokens, parents, depth, cur = [ctx.ids[-1]], [-1], [0], 0
        vocab = self.model.config.vocab_size
        for d, tok in enumerate(good, start=1):
            wrong = (tok + 1 + int(torch.randint(0, vocab - 1, (), generator=self.g))) % vocab
            right = tok if d <= cut else (tok + 1) % vocab
            kids = [wrong, right] if torch.rand((), generator=self.g) < 0.5 else [right, wrong]
            for k in kids:
                tokens.append(k)
                parents.append(cur)
                depth.append(d)
            cur = len(tokens) - 2 + kids.index(right)
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depth))


def hf_greedy(target, prompt, n):
    out = target.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts(vocab, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(3, vocab, (6,), generator=g).tolist()
        out.append(base * 3 if i % 2 else base + torch.randint(3, vocab, (5,), generator=g).tolist())  # repetitive
    return out


def tiny_drafters(target):
    from specheads.infer.scheduling.step import Scheduler

    other = tiny_target(seed=1)
    flat = {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2, 32: 1.4}
    sched = Scheduler(flat, 1e-3)  # a hand-made profile: nothing measured, no cache written
    torch.manual_seed(0)
    dspark = build_head(HeadSpec(kind="dspark", feature_layers=[1, 2, 3], block_size=4, markov_rank=16,
                                 num_layers=1, draft_vocab_size=64), target, token_counts=torch.arange(256.0))
    dflash = build_head(HeadSpec(kind="dspark", feature_layers=[4], block_size=3, markov_rank=0,
                                 confidence_head=False, sample_from_anchor=False), target)
    domino = build_head(HeadSpec(kind="domino", feature_layers=[1, 2, 3], block_size=4, markov_rank=0,
                                 confidence_head=False, domino_gru_hidden=16, domino_emb_dim=8), target)
    peagle = build_head(HeadSpec(kind="peagle", feature_layers=[1, 2, 3], num_layers=2, num_depths=4,
                                 draft_vocab_size=64), target, token_counts=torch.arange(256.0))
    eagle = EagleDrafter(build_head(HeadSpec(kind="eagle"), target), depth=2, top_k=2, total_tokens=4)
    return {
        "plain": NoDrafter(),
        "prompt-lookup": PromptLookupDrafter(num_tokens=5),
        "draft-model": DraftModelDrafter(other.model, num_tokens=3),
        "truncated": DraftModelDrafter(truncated_draft_model(target, 2), num_tokens=3),
        "oracle-tree": OracleTreeDrafter(target.model),
        "recycling": TokenRecyclingDrafter(target.vocab_size),
        "layer-skip": build_drafter(target, "layer-skip", "auto", skip="a1,m2", scheduler=Scheduler(flat, 1e-3)),
        "layer-skip-chain": build_drafter(target, "layer-skip", "3", skip="1"),
        "layer-skip+lookup": build_drafter(target, "layer-skip", "auto", skip="m1-2", lookup=4, lookup_ngram=2,
                                           scheduler=Scheduler(flat, 1e-3)),
        "recycling+lookup": combine_drafters(target, [TokenRecyclingDrafter(target.vocab_size)], lookup=4,
                                             lookup_ngram=2, scheduler=Scheduler(flat, 1e-3)),
        "medusa": MedusaDrafter(build_head(HeadSpec(kind="medusa", num_heads=3), target)),
        "eagle": EagleDrafter(build_head(HeadSpec(kind="eagle"), target), depth=3, top_k=3, total_tokens=8),
        "eagle3": EagleDrafter(build_head(HeadSpec(kind="eagle3", draft_vocab_size=64), target, token_counts=torch.arange(256.0)),
                               depth=3, top_k=3, total_tokens=8),
        "eagle+lookup": combine_drafters(target, [eagle], lookup=4, lookup_ngram=2, scheduler=sched),
        "medusa+lookup": combine_drafters(target, [MedusaDrafter(build_head(HeadSpec(kind="medusa", num_heads=2),
                                                                            target))],
                                          lookup=4, lookup_ngram=2, scheduler=Scheduler(flat, 1e-3)),
        "dspark": DSparkDrafter(dspark, scheduler=Scheduler(flat, 1e-3)),
        "dspark-chain": DSparkDrafter(dspark, num_tokens=3),
        "dflash": DSparkDrafter(dflash, scheduler=Scheduler(flat, 1e-3)),
        "domino": DSparkDrafter(domino, scheduler=Scheduler(flat, 1e-3)),
        "peagle": PEagleDrafter(peagle, scheduler=Scheduler(flat, 1e-3)),
        "peagle-chain": PEagleDrafter(peagle, num_tokens=3),
        "dspark+lookup": combine_drafters(target, [DSparkDrafter(dspark, scheduler=Scheduler(flat, 1e-3))],
                                          lookup=5, lookup_ngram=2),
        "combo": combine_drafters(target, [DSparkDrafter(dspark, scheduler=Scheduler(flat, 1e-3)),
                                           EagleDrafter(build_head(HeadSpec(kind="eagle3", draft_vocab_size=64), target,
                                                                   token_counts=torch.arange(256.0)), 2, 3, 6)],
                                  lookup=5, lookup_ngram=2, scheduler=Scheduler(flat, 1e-3)),
    }


def test_greedy_identical_to_hf_generate_every_drafter(tiny):
    ps = prompts(tiny.vocab_size, 3)
    refs = [hf_greedy(tiny, p, 24) for p in ps]
    for name, d in tiny_drafters(tiny).items():
        for p, ref in zip(ps, refs):
            r = generate(tiny, d, p, max_new_tokens=24)  # both stop at the target's eos, if it comes
            assert r.ids == ref, name
            assert r.stats.new_tokens == len(ref) and sum(r.stats.accept_hist) == r.stats.target_forwards
            assert sum(n * c for n, c in enumerate(r.stats.accept_hist)) == len(ref)  # mean = tau, last step too
        if name == "plain":
            assert r.stats.tau == 1.0
        if name == "oracle-tree":
            assert r.stats.tau > 1.5, r.stats  # the tree really is accepted, through the second child too


def test_sliding_window_target_matches_hf_generate():
    """A Gemma-3-style target (3 sliding-window layers of window 8 + 1 full layer), prompt longer than the window:
    the tree masks per layer type and the pruned sliding caches keep the output identical to HF generate."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from specheads.target import Target

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                           layer_types=["sliding_attention"] * 3 + ["full_attention"], max_position_embeddings=512,
                           pad_token_id=0, eos_token_id=2, bos_token_id=1)
    cfg._attn_implementation = "sdpa"
    model = Gemma3ForCausalLM(cfg).eval().requires_grad_(False)
    target = Target(model, None, "tiny-gemma3")
    p = torch.randint(3, 256, (20,)).tolist()
    ref = hf_greedy(target, p, 40)
    assert len(ref) > 12  # long enough to cross the window several times
    for d in (NoDrafter(), OracleTreeDrafter(model, depth=5), PromptLookupDrafter(num_tokens=4)):
        r = generate(target, d, p, max_new_tokens=40)
        assert r.ids == ref, d.name


def test_streaming_equals_non_streaming(tiny):
    p = prompts(tiny.vocab_size, 1)[0]
    d = OracleTreeDrafter(tiny.model, seed=3)
    full = generate(tiny, d, p, max_new_tokens=20, ignore_eos=True)
    gen = SpeculativeGenerator(tiny, OracleTreeDrafter(tiny.model, seed=3))
    chunks = list(gen.stream(p, max_new_tokens=20, ignore_eos=True))
    assert [x for c in chunks for x in c] == full.ids == gen.result.ids
    assert len(chunks) == gen.result.stats.target_forwards > 1

    class Collect:  # the HF streamer protocol: put(prompt [1,T]) first, then put(new ids), end()
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, v):
            self.puts.append(v.reshape(-1).tolist())

        def end(self):
            self.ended = True

    s = Collect()
    out = generate(tiny, OracleTreeDrafter(tiny.model, seed=3), p, max_new_tokens=20, ignore_eos=True, streamer=s)
    assert s.ended and s.puts[0] == p and [x for c in s.puts[1:] for x in c] == out.ids == full.ids


def test_stops_on_eos_and_max_new_tokens(tiny):
    p = prompts(tiny.vocab_size, 1)[0]
    ref = hf_greedy(tiny, p, 20)
    stop = ref[6]
    first = ref.index(stop)
    r = generate(tiny, OracleTreeDrafter(tiny.model), p, max_new_tokens=20, eos_token_ids=[stop])
    assert r.ids == ref[:first + 1] and r.stats.stop_reason == "eos"  # the stop token is emitted, as HF does
    r = generate(tiny, OracleTreeDrafter(tiny.model, depth=6), p, max_new_tokens=7, ignore_eos=True)
    assert r.ids == ref[:7] and r.stats.stop_reason == "max_new_tokens"


class CharTokenizer:
    """Token id i decodes to chr(97 + i % 26): enough to test stop strings without a real tokenizer."""
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids)


def test_stop_strings_and_bf16(tiny):
    p = prompts(tiny.vocab_size, 1)[0]
    ref = hf_greedy(tiny, p, 20)
    text = CharTokenizer().decode(ref)
    stop = text[8:10]
    end = text.index(stop) + len(stop)  # the token completing the stop string is the last one emitted
    tiny.tokenizer = CharTokenizer()
    r = generate(tiny, OracleTreeDrafter(tiny.model, depth=5), p, max_new_tokens=20, stop_strings=[stop],
                 ignore_eos=True)
    assert r.ids == ref[:end] and r.stats.stop_reason == "stop_string" and r.text == text[:end]
    bf = tiny_target(dtype=torch.bfloat16)
    out = generate(bf, PromptLookupDrafter(), p, max_new_tokens=8, ignore_eos=True)
    assert len(out.ids) == 8


def test_context_window(tiny):
    window = tiny.max_positions  # 512
    with pytest.raises(SpecheadsError, match="context window"):
        generate(tiny, NoDrafter(), list(range(3, 3 + window)), max_new_tokens=4)
    g = torch.Generator().manual_seed(0)
    p = torch.randint(3, 256, (window - 5,), generator=g).tolist()
    r = generate(tiny, OracleTreeDrafter(tiny.model, depth=4), p, max_new_tokens=50, ignore_eos=True)
    assert len(r.ids) == 5 and r.stats.stop_reason == "context_window"
    assert r.ids == hf_greedy(tiny, p, 5)


def test_sampling_is_seeded_and_runs_with_every_drafter(tiny):
    p = prompts(tiny.vocab_size, 1)[0]
    for name, d in tiny_drafters(tiny).items():  # each from the same state (token recycling's table is state)
        a = generate(tiny, copy.deepcopy(d), p, max_new_tokens=12, temperature=0.8, top_p=0.95, seed=5,
                     ignore_eos=True)
        b = generate(tiny, copy.deepcopy(d), p, max_new_tokens=12, temperature=0.8, top_p=0.95, seed=5,
                     ignore_eos=True)
        assert a.ids == b.ids and len(a.ids) == 12, name
    lossy = generate(tiny, OracleTreeDrafter(tiny.model), p, max_new_tokens=12, temperature=0.8, seed=1,
                     verification="typical-lossy", ignore_eos=True)
    assert len(lossy.ids) == 12


def test_eagle_head_cache_holds_true_rows_only(tiny):
    """After generation the head's cache equals a fresh run of the head over every true (feature, token) row."""
    head = build_head(HeadSpec(kind="eagle3"), tiny)
    d = EagleDrafter(head, depth=3, top_k=2, total_tokens=6)
    p = prompts(tiny.vocab_size, 1)[0]
    r = generate(tiny, d, p, max_new_tokens=10, ignore_eos=True)
    seq = p + r.ids
    d.propose(DraftContext(ids=seq))  # runs the pending rows; the tree's draft rows are cropped again
    n = len(seq) - 1
    assert d.cache.get_seq_length() == n == d.rows
    with torch.no_grad():
        hs = tiny.model(torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i][0] for i in head.config.feature_layers], -1)
        fresh = head.new_cache()
        mask = torch.zeros(n, n).masked_fill_(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))[None, None]
        _, logits = head.draft_forward(head.project_features(feats)[None], torch.tensor([seq[1:]]),
                                       torch.arange(n)[None], mask, fresh)
    torch.testing.assert_close(d.root_logp, torch.log_softmax(logits[0, -1].float(), -1), atol=1e-4, rtol=0)
    for a, b in zip(d.cache.layers, fresh.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-4, rtol=0)


def test_medusa_runs_only_the_heads_its_tree_reaches(tiny):
    """A tree cut to depth 1 (context window or a 1-deep --tree) runs head 0 only; the nodes equal the full tree's."""
    head = build_head(HeadSpec(kind="medusa", num_heads=3), tiny)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))  # distinct heads (blocks start as identity)
    d = MedusaDrafter(head, choices=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    d.reset([1, 2, 3], torch.randn(3, tiny.hidden_size))
    ran = []
    for k, blk in enumerate(head.blocks):
        blk.register_forward_hook(lambda m, i, o, k=k: ran.append(k))
    full = d.propose(DraftContext(ids=[1, 2, 3]))
    assert sorted(ran) == [0, 1, 2] and full.max_depth == 3
    ran.clear()
    cut = d.propose(DraftContext(ids=[1, 2, 3], max_depth=1))
    assert ran == [0]
    assert cut.tokens.tolist() == full.truncate_depth(1).tokens.tolist() == full.tokens[:3].tolist()
    ran.clear()
    d1 = MedusaDrafter(head, choices=[[0], [1]])  # a 1-deep static tree never runs heads 1 and 2
    d1.reset([1, 2, 3], torch.randn(3, tiny.hidden_size))
    assert d1.propose(DraftContext(ids=[1, 2, 3])).max_depth == 1 and ran == [0]


def test_head_target_mismatch_is_one_clear_error(tiny, tmp_path):
    build_head(HeadSpec(kind="medusa", num_heads=2), tiny).save_pretrained(tmp_path / "h")
    other = tiny_target(seed=2)
    with pytest.raises(SpecheadsError):
        load_head(str(tmp_path / "h"), other)
    assert isinstance(build_drafter(tiny, load_head(str(tmp_path / "h"), tiny)), MedusaDrafter)
    with pytest.raises(SpecheadsError, match="--drafter"):
        build_drafter(tiny, "nonsense")


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2 (slow). The full Done-when run (20 prompts x 64 new tokens x every drafter) takes ~40 min on 2 shared CPU
# cores, so by default a slice runs; SPECHEADS_FULL_EXACTNESS=1 runs all of it.
# ---------------------------------------------------------------------------------------------------------------

SMOL_PROMPTS = [
    "Write a short poem about the sea.", "What is the capital of France?", "Explain recursion to a child.",
    "List three uses of a paperclip.", "Translate 'good morning' into Spanish.", "What is 17 times 23?",
    "Give me a tip for learning to code.", "Why is the sky blue?", "Describe a cat in two sentences.",
    "Write a haiku about autumn.", "What does a CPU do?", "Name five fruits.", "Summarise the plot of Cinderella.",
    "How do plants make food?", "Write a Python function that reverses a string.", "What is gravity?",
    "Suggest a name for a pet goldfish.", "Count from one to ten in words.", "What is the boiling point of water?",
    "Tell me a fun fact about octopuses.",
]


def smol_drafters(target):
    from specheads.infer.scheduling.step import Scheduler

    small = dict(depth=3, top_k=4, total_tokens=12)  # untrained heads: small trees keep the test affordable
    flat = {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1}  # a hand-made profile: the untrained block is verified most steps
    dspark = build_head(HeadSpec(kind="dspark", block_size=4, markov_rank=32), target).eval()
    return {
        "prompt-lookup": PromptLookupDrafter(num_tokens=5),
        "draft-model": DraftModelDrafter(truncated_draft_model(target, 4), num_tokens=3),
        "medusa": MedusaDrafter(build_head(HeadSpec(kind="medusa", num_heads=3), target),
                                choices=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
        "eagle": EagleDrafter(build_head(HeadSpec(kind="eagle"), target), **small),
        "eagle3": EagleDrafter(build_head(HeadSpec(kind="eagle3"), target), **small),
        "dspark": DSparkDrafter(dspark, scheduler=Scheduler(flat, 0.03)),
        "dspark+lookup": combine_drafters(target, [DSparkDrafter(dspark, scheduler=Scheduler(flat, 0.03))],
                                          lookup=6, lookup_ngram=2),
    }


@pytest.mark.slow
def test_greedy_identical_to_hf_generate_smollm2(smollm2):
    import os

    full = os.environ.get("SPECHEADS_FULL_EXACTNESS") == "1"
    n_prompts, n_new = (20, 64) if full else (2, 24)
    from specheads.infer.engine.generate import encode_prompt

    torch.manual_seed(0)
    drafters = smol_drafters(smollm2)
    for text in SMOL_PROMPTS[:n_prompts]:
        ids = encode_prompt(smollm2, messages=[{"role": "user", "content": text}])
        ref = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=n_new, do_sample=False)[0, len(ids):].tolist()
        for name, d in drafters.items():
            r = generate(smollm2, d, ids, max_new_tokens=n_new)
            assert r.ids == ref, (name, text)


@pytest.mark.slow
def test_cli_generate_smollm2(capsys):
    import json

    from specheads.cli import main

    assert main(["generate", "--target", "smollm2-135m", "--prompt", "Count to five.", "--max-new-tokens", "8",
                 "--drafter", "prompt-lookup", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["stats"]["new_tokens"] == 8 and out["stats"]["tau"] >= 1.0 and isinstance(out["text"], str)
    assert main(["generate", "--target", "smollm2-135m", "--prompt", "Hi", "--max-new-tokens", "6", "--stop", "x",
                 "--temperature", "0.7", "--seed", "1"]) == 0
    err = capsys.readouterr().err
    assert "tau" in err and "target forwards" in err
    assert main(["generate", "--target", "smollm2-135m", "--prompt", "Hi", "--drafter", "prompt-lookup",
                 "--tree", "wide"]) == 2  # one-line error, exit code 2


def test_eagle_tree_rows_equal_sequential_head_runs(tiny, monkeypatch):
    """Every expanded node's draft log-probs equal a plain causal head run over the true rows plus that node's own
    path (siblings invisible, positions by depth), to 1e-5 (fp32)."""
    import specheads.infer.drafters.eagle as drafters_mod

    seen = []  # (path tokens below the root, log-probs the tree builder received)
    real = drafters_mod.dynamic_tree

    def spy(root, expand, *a, **k):
        def wrapped(frontier, tokens, parents):
            out = expand(frontier, tokens, parents)
            for row, i in enumerate(frontier):
                path, j = [], i
                while j > 0:
                    path.append(tokens[j])
                    j = parents[j]
                seen.append((path[::-1], out[row].clone()))
            return out
        return real(root, wrapped, *a, **k)

    monkeypatch.setattr(drafters_mod, "dynamic_tree", spy)
    head = build_head(HeadSpec(kind="eagle"), tiny)
    d = EagleDrafter(head, depth=3, top_k=2, total_tokens=100)  # keep every generated node
    seq = prompts(tiny.vocab_size, 1)[0]
    n = len(seq) - 1
    with torch.no_grad():
        hs = tiny.model(torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i][0] for i in head.config.feature_layers], -1)  # [n, D]
        d.reset(torch.tensor(seq), feats)
        tree = d.propose(DraftContext(ids=seq))
        assert len(tree) == 1 + 2 + 4 + 4 and d.cache.get_seq_length() == n  # draft rows cropped again
        assert len(seen) == 1 + 2 + 2 and max(len(p) for p, _ in seen) == 2

        def chain_run(path_tokens):  # true rows, then one row per path token fed with the previous row's output
            cache = head.new_cache()
            s = n
            mask = torch.zeros(s, s).masked_fill_(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
            h, lg = head.draft_forward(feats[None], torch.tensor([seq[1:]]), torch.arange(n)[None],
                                       mask[None, None], cache)
            h = h[:, -1:]
            for j, tok in enumerate(path_tokens):
                s += 1
                h, lg = head.draft_forward(h, torch.tensor([[tok]]), torch.tensor([[n + j]]),
                                           torch.zeros(1, 1, 1, s), cache)
            return torch.log_softmax(lg[0, -1].float(), -1)

        for path, lp in seen:
            torch.testing.assert_close(lp, chain_run(path), atol=1e-5, rtol=0)


def test_cli_tree_auto_needs_a_head(capsys, monkeypatch):
    import specheads.target
    from specheads.cli import main

    def no_load(*a, **k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(specheads.target, "load_target", no_load)  # refused before any model is loaded
    assert main(["generate", "--prompt", "Hi", "--drafter", "prompt-lookup", "--tree", "auto"]) == 2
    assert "--tree auto: needs --head" in capsys.readouterr().err


def test_cli_generate_takes_a_dspark_head(tiny, tmp_path, capsys, monkeypatch):
    """`specheads generate --head DIR` with a DSpark head: its tree forms checked against the folder before any
    model loads, then (auto, the default) the scheduled drafter streams and reports the scheduler's figures."""
    import specheads.infer.drafters.build as drafters_mod
    import specheads.target
    from specheads.cli import main
    from specheads.infer.scheduling.step import Scheduler

    build_head(HeadSpec(kind="dspark", feature_layers=[1, 2, 3], block_size=4, markov_rank=8), tiny
               ).save_pretrained(tmp_path / "ds")
    base = ["generate", "--head", str(tmp_path / "ds"), "--prompt", "hi", "--raw", "--json"]

    def no_load(*a, **k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(specheads.target, "load_target", no_load)
    assert main(base + ["--tree", "9"]) == 2
    assert "--tree 9: the number of draft tokens 9 is outside 1..4; a DSpark head takes auto" in capsys.readouterr().err

    class Tok:
        eos_token_id = None

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [1] + [3 + b % 250 for b in text.encode()] * 3}

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    tiny.tokenizer = Tok()
    monkeypatch.setattr(specheads.target, "load_target", lambda *a, **k: tiny)
    monkeypatch.setattr(drafters_mod.Scheduler, "for_target",
                        classmethod(lambda cls, target, refresh=False, pricing="measured":
                                    Scheduler({1: 1.0, 8: 1.1}, 1e-3, pricing=pricing)))
    for extra in ([], ["--lookup", "4"]):
        assert main(base + ["--max-new-tokens", "8"] + extra) == 0
        out = json.loads(capsys.readouterr().out)
        assert len(out["ids"]) == 8 and out["stats"]["scheduled_steps"] == out["stats"]["target_forwards"]
        assert bool(out["stats"]["source_tokens"]) == bool(extra)


@pytest.mark.slow
def test_cli_generate_tree_auto_smollm2(smollm2, tmp_path, capsys):
    import json

    from specheads.cli import main
    from specheads.heads.base import HeadSpec, build_head, load_head

    build_head(HeadSpec(kind="eagle3", draft_vocab_size=1024), smollm2).save_pretrained(tmp_path / "head")
    assert main(["generate", "--target", "smollm2-135m", "--head", str(tmp_path / "head"), "--tree", "auto",
                 "--prompt", "Count to five.", "--max-new-tokens", "8", "--json"]) == 0
    cap = capsys.readouterr()
    assert "--tree auto: EAGLE-2 dynamic tree" in cap.err
    out = json.loads(cap.out.strip().splitlines()[-1])
    assert out["stats"]["new_tokens"] == 8


def test_phase_timer_adds_each_block_even_when_it_raises():
    import time

    from specheads.infer.engine.generate import phase_timer

    t = {"draft": 0.0}
    with phase_timer(t, "draft"):
        time.sleep(0.01)
    with pytest.raises(RuntimeError):
        with phase_timer(t, "draft"):
            time.sleep(0.01)
            raise RuntimeError
    assert t["draft"] >= 0.02


def test_stats_phases_cover_the_steps(tiny):
    r = generate(tiny, OracleTreeDrafter(tiny.model), prompts(tiny.vocab_size, 1)[0], max_new_tokens=12,
                 ignore_eos=True)
    s = r.stats
    assert set(s.timings) == {"draft", "tree", "target", "verify", "cache", "other"}
    assert all(v > 0 for v in s.timings.values()) and sum(s.timings.values()) <= s.wall_s - s.prefill_s
    assert s.stop_reason == "max_new_tokens" and s.tree_nodes > s.target_forwards  # trees of several nodes
