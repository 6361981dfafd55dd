"""Batched speculative generation (infer/engine/batch.py), the batch verify budget (infer/scheduling/batch_budget.py) and the
rows x tokens cost surface (infer/scheduling/profile.py): every row's greedy output equals that row decoded alone (fp32), with
rows of different lengths, rows finishing early and prompts joining; sampling draws each row from its own
generator and keeps the target's distribution; hand-made packing, pruning and budget cases."""

import pytest
import torch

from specheads.heads.base import HeadSpec, build_head
from specheads.infer.drafters import (Drafter, DraftModelDrafter, DSparkDrafter, EagleDrafter, MedusaDrafter, NoDrafter,
                                      PEagleDrafter, PromptLookupDrafter, TokenRecyclingDrafter, combine_drafters)
from specheads.infer.engine import batch as batch_mod
from specheads.infer.engine.batch import generate_batch, pack_trees
from specheads.infer.engine.generate import generate
from specheads.kvcache import keep_accepted_rows, merge_caches, new_batch_cache
from specheads.infer.scheduling.batch_budget import (AcceptanceTracker, BudgetScheduler, ExploreClock,
                                                     choose_batch_budget, effective_survival)
from specheads.infer.scheduling.step import Scheduler
from specheads.infer.tree import DraftTree, chain_tree
from specheads.infer.verify import Accepted, greedy_batch_on_device, verify_greedy
from specheads.target import tiny_target
from specheads.utils import SpecheadsError

FLAT = {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2, 32: 1.4}  # a hand-made cost profile: nothing measured
from helpers import Recording
from test_generate import OracleTreeDrafter, hf_greedy

# Small sequential forwards: one intra-op thread is several times faster than two on a shared CPU.
pytestmark = pytest.mark.usefixtures("one_thread")


def mixed_prompts(vocab, n, seed=0):
    """Prompts of different lengths (1 .. 25 tokens), every other one repetitive (prompt lookup finds drafts)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(3, vocab, (2 + 2 * i,), generator=g).tolist()
        out.append(base * 3 if i % 2 else base + torch.randint(3, vocab, (3,), generator=g).tolist())
    out[-1] = out[-1][:1]  # a one-token prompt: nothing to prefill
    return out


def row_makers(target):
    """name -> make_drafter (a fresh drafter per row; heads shared, read only)."""
    medusa = build_head(HeadSpec(kind="medusa", num_heads=3), target)
    eagle3 = build_head(HeadSpec(kind="eagle3", draft_vocab_size=64), target, token_counts=torch.arange(256.0))
    dspark = build_head(HeadSpec(kind="dspark", block_size=3, draft_vocab_size=64), target,
                        token_counts=torch.arange(256.0))
    peagle = build_head(HeadSpec(kind="peagle", num_layers=2, num_depths=3, draft_vocab_size=64), target,
                        token_counts=torch.arange(256.0))
    small = tiny_target(seed=1)
    return {
        "dspark": lambda: DSparkDrafter(dspark),
        "peagle": lambda: PEagleDrafter(peagle),
        "recycling": lambda: TokenRecyclingDrafter(target.vocab_size),
        "plain": NoDrafter,
        "prompt-lookup": lambda: PromptLookupDrafter(num_tokens=5),
        "oracle-tree": lambda: OracleTreeDrafter(target.model, seed=1),
        "draft-model": lambda: DraftModelDrafter(small.model, num_tokens=3),
        "medusa": lambda: MedusaDrafter(medusa),
        "eagle3": lambda: EagleDrafter(eagle3, depth=3, top_k=3, total_tokens=8),
        "eagle3+lookup": lambda: combine_drafters(target, [EagleDrafter(eagle3, depth=2, top_k=2, total_tokens=4)],
                                                  lookup=4, lookup_ngram=2, scheduler=Scheduler(FLAT, 1e-3),
                                                  explore_every=1),  # no resting: its choice is timing's
    }


def test_greedy_rows_equal_hf_generate_every_drafter(tiny):
    """5 prompts of 1..17 tokens, 3 rows at a time (two prompts join as rows finish), 16 new tokens: every row is
    HF generate's greedy output of that prompt alone, token for token, and drafts as it does alone (the same
    trees: each drafter got its own row's features); forwards and histograms add up."""
    ps = mixed_prompts(tiny.vocab_size, 5)
    refs = [hf_greedy(tiny, p, 16) for p in ps]
    for name, make in row_makers(tiny).items():
        logs = []

        def recorded():
            logs.append([])
            return Recording(make(), logs[-1])

        res = generate_batch(tiny, recorded, ps, 16, batch_size=3)
        for i, (row, ref) in enumerate(zip(res.rows, refs)):
            assert row.ids == ref, (name, i)
            alone = []
            generate(tiny, Recording(make(), alone), ps[i], max_new_tokens=16)
            assert logs[i] == alone, (name, i)  # rows join in prompt order: drafter i is row i's
            assert sum(row.stats.accept_hist) == row.stats.target_forwards
            assert sum(n * c for n, c in enumerate(row.stats.accept_hist)) == len(ref)
        s = res.stats
        assert s.new_tokens == sum(map(len, refs)) and s.row_forwards == sum(r.stats.target_forwards for r in res.rows)
        assert s.max_rows == 3 and s.prefills >= 2 and s.tau == pytest.approx(s.new_tokens / s.row_forwards)
        if name == "plain":
            assert s.tau == 1.0 and s.padded_nodes == s.tree_nodes
        if name == "oracle-tree":
            assert s.tau > 1.5, s  # the trees are accepted, second children included


def test_rows_finish_early_stop_tokens_and_caps(tiny):
    """Rows stop at their own cap (one at 0 and one at 1 token), at a stop token, at the context window; a waiting
    prompt joins each time; each row equals `generate` of that prompt alone with the same settings."""
    ps = mixed_prompts(tiny.vocab_size, 6, seed=3)
    ps[2] = torch.randint(3, 256, (tiny.max_positions - 4,), generator=torch.Generator().manual_seed(1)).tolist()
    caps = [12, 0, 20, 1, 9, 14]
    stop = hf_greedy(tiny, ps[0], 12)[5]  # ends row 0 at its 6th token (or earlier)
    make = lambda: OracleTreeDrafter(tiny.model, depth=4, seed=2)  # noqa: E731
    res = generate_batch(tiny, make, ps, caps, batch_size=2, eos_token_ids=[stop])
    for i, (p, cap) in enumerate(zip(ps, caps)):
        alone = generate(tiny, OracleTreeDrafter(tiny.model, depth=4, seed=2), p, max_new_tokens=cap,
                         eos_token_ids=[stop])
        assert res.rows[i].ids == alone.ids, i
        assert res.rows[i].stats.stop_reason == alone.stats.stop_reason, i
    reasons = [r.stats.stop_reason for r in res.rows]
    assert reasons[0] == "eos" and reasons[1] == "max_new_tokens" and reasons[2] == "context_window"
    assert res.rows[1].ids == [] and len(res.rows[3].ids) == 1 and res.stats.max_rows == 2


def test_batched_device_verify_path_gives_the_same_rows(tiny, monkeypatch):
    """The accelerator's verification (every greedy row in one greedy_batch_on_device call) forced on the CPU: the
    same tokens, accepted lengths and forwards as the per-row host walk, with padded rows of different tree sizes
    (oracle trees with siblings, prompt lookup's chains) and rows joining and leaving."""
    ps = mixed_prompts(tiny.vocab_size, 5, seed=4)
    makers = {"oracle-tree": lambda: OracleTreeDrafter(tiny.model, depth=4, seed=3),
              "prompt-lookup": lambda: PromptLookupDrafter(num_tokens=4)}
    host = {n: generate_batch(tiny, m, ps, 12, batch_size=3) for n, m in makers.items()}
    calls = []

    def on_device(verifies, trees, logits):  # what verify_rows does with logits off the host
        assert all(v is verify_greedy for v in verifies)
        calls.append(len(trees))
        return greedy_batch_on_device(trees, logits)

    monkeypatch.setattr(batch_mod, "verify_rows", on_device)
    for name, make in makers.items():
        dev = generate_batch(tiny, make, ps, 12, batch_size=3)
        for a, b in zip(host[name].rows, dev.rows):
            assert (a.ids, a.stats.accept_hist, a.stats.target_forwards) == \
                   (b.ids, b.stats.accept_hist, b.stats.target_forwards), name
        assert dev.stats.target_forwards == host[name].stats.target_forwards
    assert len(calls) == sum(r.stats.target_forwards for r in host.values()) and max(calls) == 3


def test_sampling_rows_equal_each_row_alone_with_its_seed(tiny):
    """Row i draws from its own generator (seed + i): its tokens equal `generate(seed=seed + i)` of that prompt
    alone, whatever else shares the batch."""
    ps = mixed_prompts(tiny.vocab_size, 4, seed=5)
    eagle3 = build_head(HeadSpec(kind="eagle3"), tiny)
    small = tiny_target(seed=1)
    makers = {"prompt-lookup": lambda: PromptLookupDrafter(num_tokens=4),
              "draft-model": lambda: DraftModelDrafter(small.model, num_tokens=3),  # q recorded: sampled drafts
              "eagle3": lambda: EagleDrafter(eagle3, depth=2, top_k=2, total_tokens=4)}
    for name, make in makers.items():
        res = generate_batch(tiny, make, ps, 10, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
        for i, p in enumerate(ps):
            alone = generate(tiny, make(), p, max_new_tokens=10, temperature=0.8, top_p=0.95, seed=7 + i,
                             ignore_eos=True)
            assert res.rows[i].ids == alone.ids, (name, i)


def test_sampling_keeps_the_target_distribution():
    """600 rows of one prompt in one batch (prompt lookup drafts, point masses): the first emitted token is
    distributed as the target's softmax(logits / T) (chi-square, bins of expected count >= 5, p > 0.001)."""
    from scipy.stats import chisquare

    target = tiny_target(vocab_size=32)
    base = [5, 9, 11, 7]
    prompt = base * 3 + base[:2]  # lookup drafts the repeat: the first step verifies a chain
    rows = 600
    res = generate_batch(target, lambda: PromptLookupDrafter(num_tokens=3), [prompt] * rows, 1, temperature=1.0,
                         seed=0, ignore_eos=True)
    with torch.no_grad():
        p = torch.softmax(target.model(torch.tensor([prompt])).logits[0, -1].double(), -1)
    counts = torch.bincount(torch.tensor([r.ids[0] for r in res.rows]), minlength=32).double()
    exp = p * rows
    big = exp >= 5
    obs_b = torch.cat([counts[big], counts[~big].sum()[None]])
    exp_b = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = exp_b > 0
    assert chisquare(obs_b[keep].numpy(), exp_b[keep].numpy()).pvalue > 1e-3
    assert res.stats.max_rows == rows and res.stats.target_forwards == 1


def test_pack_trees_masks_and_positions_by_hand():
    """Row 0: 3 cached entries, a chain root -> a; row 1: 1 cached entry (columns 1, 2 are row 0's length), the
    root alone (node 1 is padding). cols = 3, N = 2: mask columns [c0 c1 c2 | n0 n1]."""
    trees = [chain_tree(7, [8]), chain_tree(9, [])]
    tokens, pos, mask = pack_trees(trees, [3, 1], 3, torch.float32)
    assert tokens.tolist() == [[7, 8], [9, 9]] and pos.tolist() == [[3, 4], [1, 1]]
    ok = (mask == 0).int()[:, 0].tolist()
    assert ok[0] == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert ok[1] == [[1, 0, 0, 1, 0], [0, 0, 0, 0, 1]]  # padding node: only itself


class _Layer:
    def __init__(self, keys):
        self.keys, self.values, self.is_initialized = keys, keys.clone() + 100, True


class _Cache:
    def __init__(self, keys):
        self.layers = [_Layer(keys)]


def test_keep_accepted_rows_moves_each_rows_nodes_down():
    """keys[b, 0, c, 0] = 10 b + c: after a forward of N = 3 nodes over cols = 4, row 0 (length 4) keeps nodes
    0, 2 and row 1 (length 2) keeps node 0: row 0 columns 4, 5 <- 4, 6; row 1 column 2 <- 4; cut to 6 columns."""
    keys = (10 * torch.arange(2.0)[:, None] + torch.arange(7.0)[None]).reshape(2, 1, 7, 1)
    cache = _Cache(keys)
    new = keep_accepted_rows(cache, 4, [4, 2], [[0, 2], [0]])
    assert new == [6, 3]
    got = cache.layers[0].keys[:, 0, :, 0]
    assert got.shape == (2, 6)
    assert got[0].tolist() == [0, 1, 2, 3, 4, 6] and got[1, :3].tolist() == [10, 11, 14]
    assert cache.layers[0].values[1, 0, 2, 0] == 114  # values move with their keys


def test_merge_caches_pads_the_shorter_rows(tiny):
    a, b = new_batch_cache(tiny.model), new_batch_cache(tiny.model)
    with torch.no_grad():
        tiny.model(input_ids=torch.tensor([[3, 4, 5]]), cache=a, use_cache=True)
        tiny.model(input_ids=torch.tensor([[6, 7], [8, 9]]), cache=b, use_cache=True)
    k_a = a.layers[0].keys.clone()
    merge_caches(a, b, 1, 2)
    k = a.layers[0].keys
    assert k.shape[0] == 3 and k.shape[2] == 3 and torch.equal(k[0], k_a[0]) and bool((k[1:, :, 2] == 0).all())


def test_sliding_window_target_is_refused():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from specheads.target import Target

    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128)
    target = Target(Gemma3ForCausalLM(cfg).eval(), None, "tiny-gemma3")
    with pytest.raises(SpecheadsError, match="sliding-window"):
        generate_batch(target, None, [[3, 4, 5]], 4)


def test_bad_input_is_one_clear_error(tiny):
    with pytest.raises(SpecheadsError, match="no prompts"):
        generate_batch(tiny, None, [], 4)
    with pytest.raises(SpecheadsError, match="max_new_tokens has 1 values for 2"):
        generate_batch(tiny, None, [[3], [4]], [4])
    with pytest.raises(SpecheadsError, match="batch_size"):
        generate_batch(tiny, None, [[3]], 4, batch_size=0)
    with pytest.raises(SpecheadsError, match="context window"):
        generate_batch(tiny, None, [[3] * tiny.max_positions], 4)


# ------------------------------------------------------------------------------------------- the verify budget
def test_budget_by_hand_padded_and_flat():
    """Row 0 chain survivals 0.9, 0.8, 0.1; row 1: 0.5. Cheap cost 1 + 0.1 (n - 1): width 3 is best
    (E = 2 + 0.9 + 0.8 + 0.5 = 4.2 over 1.2 = 3.5; width 4 gives 4.3 / 1.3 = 3.31; plain 2). Cost n: plain."""
    surv = [[1, 0.9, 0.8, 0.1], [1, 0.5]]
    c = choose_batch_budget(surv, lambda B, n: 1 + 0.1 * (n - 1))
    assert c.keep == [[0, 1, 2], [0, 1]] and c.budgets == [2, 1] and c.tokens_per_row == 3
    assert c.expected_tokens == pytest.approx(4.2) and c.expected_rate == pytest.approx(3.5) and c.plain_rate == 2
    plain = choose_batch_budget(surv, lambda B, n: float(n))
    assert plain.budgets == [0, 0] and plain.keep == [[0], [0]] and plain.expected_rate == plain.plain_rate == 2
    # flat: L draft tokens cost 1 + 0.05 L; the 0.1 node does not pay for itself (4.3 / 1.2 < 4.2 / 1.15)
    flat = choose_batch_budget(surv, lambda B, n: 1 + 0.1 * (n - 1), packing="flat")
    assert flat.budgets == [2, 1] and flat.expected_rate == pytest.approx(4.2 / 1.15)


def test_budget_padded_equals_brute_force_and_never_expects_less_than_plain():
    """Random rows and monotone costs: the padded choice is the best width with every row filled (brute force),
    and its expected rate is never below plain decoding's."""
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        B = int(torch.randint(1, 6, (1,), generator=g))
        surv = [[1.0] + torch.rand(int(torch.randint(0, 6, (1,), generator=g)), generator=g).cumprod(0).tolist()
                for _ in range(B)]
        slope = float(torch.rand((), generator=g)) * B
        cost = lambda b, n, s=slope: 1 + s * (n - 1) ** 1.2  # noqa: E731
        c = choose_batch_budget(surv, cost)
        brute = max(sum(1 + sum(sorted(s[1:], reverse=True)[:n - 1]) for s in surv) / cost(B, n)
                    for n in range(1, 2 + max(len(s) for s in surv)))
        assert c.expected_rate == pytest.approx(brute) and c.expected_rate >= c.plain_rate


def test_effective_survival_keeps_parents_and_earlier_siblings_first():
    # root -> 1, 2 (siblings); 1 -> 3. Node 2 claims more than node 1 and node 3 more than its parent
    eff = effective_survival([1, 0.3, 0.6, 0.9], [-1, 0, 0, 1])
    assert eff == [1, 0.3, 0.3, 0.3]
    c = choose_batch_budget([[1, 0.3, 0.6, 0.9]], lambda B, n: 1 + 0.5 * (n - 1), parents=[[-1, 0, 0, 1]])
    assert all(p in k for k in c.keep for i in k if i for p in [[-1, 0, 0, 1][i]])


def test_tracker_learns_depth_and_rank_rates():
    t = AcceptanceTracker(prior=0.5, prior_weight=2, shrink=4)
    tree = DraftTree(torch.tensor([0, 5, 6, 7]), torch.tensor([-1, 0, 0, 1]), torch.tensor([0, 1, 1, 2]))
    for _ in range(20):  # rank-0 child always accepted, its child never; rank 1 tried each time, never accepted
        t.observe("a", tree, Accepted([0, 1], 9))
    assert t.alpha("a", 1, 0) > 0.9 and t.alpha("a", 1, 1) < 0.1 and t.alpha("a", 2, 0) < 0.1
    s = t.survival("a", tree)
    assert s[1] > 0.9 and s[3] == pytest.approx(s[1] * t.alpha("a", 2, 0))
    assert t.alpha("new row", 1, 0) > 0.8  # a new row starts from the pooled rate


def test_budget_scheduler_keeps_rows_exact_and_follows_the_cost(tiny):
    """With the scheduler the rows stay HF's greedy output. On a surface where every extra token costs a full
    forward it verifies only roots except on exploring steps (one per explore_every + 1) and skips drafting on the
    steps between; on a free surface it keeps the accepted oracle trees whole."""
    ps = mixed_prompts(tiny.vocab_size, 4, seed=2)
    refs = [hf_greedy(tiny, p, 12) for p in ps]
    logs = []

    def make():
        logs.append([])
        return Recording(OracleTreeDrafter(tiny.model, depth=4, seed=3), logs[-1])

    dear = BudgetScheduler(lambda B, n: float(B * n), explore_every=4)
    res = generate_batch(tiny, make, ps, 12, scheduler=dear)
    assert [r.ids for r in res.rows] == refs
    steps = len(dear.choices)
    wide = sum(n > 1 for _, n, _ in dear.choices)
    assert 1 <= wide <= steps // 5 + 1  # only the exploring steps verify a draft node
    drafted = sum(len(tokens) > 1 for log in logs for tokens, _ in log)
    assert drafted <= sum(len(log) for log in logs) // 2 + len(ps)  # most steps draft nothing
    free = BudgetScheduler(lambda B, n: 1.0, draft_cost=0.0)  # the surface alone (the oracle drafts slowly)
    res2 = generate_batch(tiny, lambda: OracleTreeDrafter(tiny.model, depth=4, seed=3), ps, 12, scheduler=free)
    assert [r.ids for r in res2.rows] == refs and res2.stats.tau > 1.5 > res.stats.tau


class Replay(Drafter):
    """Drafts the next k tokens of the known greedy answer (always accepted); counts the steps it may draft."""
    feature_layers = None

    def __init__(self, answers: dict, k: int, calls: list):
        self.answers, self.k, self.calls = answers, k, calls

    def reset(self, prompt_ids, features):
        self.prompt = [int(t) for t in prompt_ids]

    def propose(self, ctx):
        if ctx.max_depth <= 0:
            return chain_tree(ctx.ids[-1], [])
        self.calls.append(1)
        done = len(ctx.ids) - len(self.prompt)
        return chain_tree(ctx.ids[-1], self.answers[tuple(self.prompt)][done:done + min(self.k, ctx.max_depth)])


def test_budget_counts_the_drafting_rows_rest_when_it_does_not_pay(tiny):
    """On a free verify surface, always-accepted drafts whose drafting costs 20 target forwards per row never pay:
    the rows rest (most steps draft nothing) and stay HF's greedy output; with drafting free they draft on every
    step (τ above 2)."""
    ps = mixed_prompts(tiny.vocab_size, 4, seed=2)
    refs = [hf_greedy(tiny, p, 24) for p in ps]
    answers = {tuple(p): r for p, r in zip(ps, refs)}
    runs = {}
    for d in (20.0, 0.0):
        calls = []
        sched = BudgetScheduler(lambda B, n: 1.0, explore_every=8, draft_cost=d)
        res = generate_batch(tiny, lambda: Replay(answers, 3, calls), ps, 24, scheduler=sched)
        assert [r.ids for r in res.rows] == refs
        runs[d] = (len(calls), sum(r.stats.target_forwards for r in res.rows), res.stats.tau)
    calls, steps, tau = runs[20.0]
    assert calls <= steps // 3, runs  # resting, drafting again on exploring steps only
    calls, steps, tau = runs[0.0]
    assert calls == steps and tau > 2.0, runs


def test_budget_measures_the_drafting_cost_in_forwards():
    """observe reads t(1, 1) off the step's forward (target_s / cost(B, n)) and one row's drafting in that unit;
    a row whose gain is below d times the rate rests, one whose gain pays drafts on; when the rate with drafting
    counted falls to plain decoding's, every row rests."""
    # survivals: "good" 0.96, 0.93 (gain g = 1.89), "bad" 0.04, 0.001 (g = 0.04); cost 1.2 at 3 tokens per row
    for draft_s, limits in ((0.004, [None, 0]), (0.02, [0, 0])):
        sched = BudgetScheduler(lambda B, n: 1.0 + 0.1 * (n - 1))
        trees = [chain_tree(1, [2, 3]), chain_tree(4, [5, 6])]
        sched.tracker.rows = {"good": {(1, 0): [50, 50], (2, 0): [50, 50]},
                              "bad": {(1, 0): [0, 50], (2, 0): [0, 50]}}
        cut = sched.select(trees, ["good", "bad"])
        assert [len(t) for t in cut] == [3, 3]  # both rows filled to the width the good row pays for
        acc = [Accepted([0, 1, 2], 7), Accepted([0], 8)]
        sched.observe(["good", "bad"], cut, acc, draft_s=draft_s, target_s=0.012)  # t(1,1) = 0.012 / 1.2 = 10 ms
        assert sched.unit_s == [pytest.approx(0.01)]
        assert sched.draft_units == [pytest.approx(draft_s / 0.01 / 2)]  # d = 0.2, then 1.0 forwards per row
        # d 0.2: both rows E 3.93 / (1.2 + 0.4) = 2.46 > 0.04 / 0.2; the good row alone 3.89 / 1.4 = 2.78 > plain 2
        # d 1.0: the good row alone 3.89 / 2.2 = 1.77 < plain 2 / 1.0
        assert sched.depth_limits(["good", "bad"]) == limits


def test_resting_rows_explore_together_and_back_off():
    """Where verifying never pays (every node costs a forward), the resting rows draft again all on one step; each
    exploring step that finds nothing doubles the wait (2, 4, 8, then the cap 8); a row that joins while the clock
    backs off starts resting; an exploring step on which a row pays sets the wait back to the base."""
    clock = ExploreClock(base=2, longest=8)
    sched = BudgetScheduler(lambda B, n: float(B * n), clock=clock, draft_cost=0.0)
    rows, drafting_steps = ["a", "b"], []
    for step in range(40):
        limits = sched.depth_limits(rows) or [None] * len(rows)
        if any(x is None for x in limits):
            assert all(x is None for x in limits)  # together: every row or none
            drafting_steps.append(step)
        trees = [chain_tree(1, [2] if x is None else []) for x in limits]
        cut = sched.select(trees, rows)
        sched.observe(rows, cut, [Accepted([0], 5)] * len(rows), draft_s=0.0, target_s=0.01)
    gaps = [b - a for a, b in zip(drafting_steps, drafting_steps[1:])]
    assert gaps[:5] == [3, 5, 9, 9, 9], drafting_steps  # rested 2, 4, 8, 8, 8 steps between drafting steps
    assert clock.backed_off and sched.depth_limits(["a", "b", "c"]) == [0, 0, 0]  # "c" joins resting
    free = BudgetScheduler(lambda B, n: 1.0, clock=clock, draft_cost=0.0)  # now verifying is free: rows pay
    free.resting, free.seen = {"a"}, {"a"}
    clock.since = clock.rest_steps
    assert free.depth_limits(["a"]) is None  # due: "a" explores
    cut = free.select([chain_tree(1, [2, 3])], ["a"])
    free.observe(["a"], cut, [Accepted([0, 1, 2], 5)], draft_s=0.0, target_s=0.01)
    assert clock.rest_steps == 2 and "a" not in free.resting


def test_dspark_rows_resting_skip_the_head_and_stay_exact(tiny):
    """A DSpark row that rests runs no head pass (its verified features wait for the next block); when it drafts
    again the context holds every verified row, so output stays greedy-exact."""
    ps = mixed_prompts(tiny.vocab_size, 3, seed=4)
    refs = [hf_greedy(tiny, p, 20) for p in ps]
    head = build_head(HeadSpec(kind="dspark", block_size=3, draft_vocab_size=64), tiny,
                      token_counts=torch.arange(256.0))
    passes = []
    real = head.extend_context
    head.extend_context = lambda cache, f: passes.append(f.shape[-2] if f.dim() == 3 else f.shape[0]) or real(cache, f)
    dear = BudgetScheduler(lambda B, n: float(B * n), explore_every=4)  # nothing pays: rows rest
    res = generate_batch(tiny, lambda: DSparkDrafter(head), ps, 20, scheduler=dear)
    assert [r.ids for r in res.rows] == refs
    steps = sum(r.stats.target_forwards for r in res.rows)
    assert len(passes) <= steps // 2 + len(ps), (len(passes), steps)
    assert max(passes) > 1  # a pass caught up several verified rows at once


# ------------------------------------------------------------------------------------------- the cost surface
def test_batch_cost_surface_measured_cached_and_interpolated(tiny, tmp_path, monkeypatch):
    from specheads.infer.scheduling import profile
    from specheads.infer.scheduling.costs import batch_cost_fn, batch_costs

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    calls = []
    real = profile.measure_batch_cost
    monkeypatch.setattr(profile, "measure_batch_cost", lambda *a, **k: calls.append(1) or real(*a, **k))
    prof = profile.load_or_profile_batch(tiny, rows=(1, 2, 4), tokens=(1, 2, 4), context=16, repeats=2)
    rel = prof["batch"]["relative"]
    assert sorted(rel) == ["1", "2", "4"] and rel["1"]["1"] == pytest.approx(1.0)
    costs = batch_costs(prof)
    assert all(costs[(b, n)] <= costs[(b, 2 * n)] for b in (1, 2, 4) for n in (1, 2))  # fitted monotone in n
    assert all(costs[(b, n)] <= costs[(2 * b, n)] for b in (1, 2) for n in (1, 2, 4))  # and in B
    fn = batch_cost_fn(prof)
    assert fn(1, 1) == pytest.approx(1.0) and fn(3, 3) == pytest.approx(
        (costs[(2, 2)] + costs[(2, 4)] + costs[(4, 2)] + costs[(4, 4)]) / 4)
    if not prof["noisy"]:  # a profile measured on a busy machine is never trusted later
        again = profile.load_or_profile_batch(tiny, rows=(1, 2, 4), tokens=(1, 2, 4), context=16, repeats=2)
        assert again["cached"] and len(calls) == prof["attempts"]
    assert profile.batch_profile_path(tiny, tiny.dtype).name.endswith("-batch.json")
    one = profile.load_or_profile(tiny, sizes=(1, 2), context=16, repeats=1)  # the batch-1 profile: its own file
    assert set(one["verify"]["relative"]) == {"1", "2"} and one["path"] != prof["path"]


def test_monotone_surface_and_noise_guard():
    from specheads.infer.scheduling.costs import monotone_surface, surface_drop
    from specheads.infer.scheduling.profile import profile_noise

    raw = {(1, 1): 1.0, (1, 2): 1.4, (2, 1): 1.2, (2, 2): 1.1}  # (2, 2) measured below (2, 1) and (1, 2)
    fit = monotone_surface(raw, (1, 2), (1, 2))
    assert fit[(2, 2)] >= max(fit[(2, 1)], fit[(1, 2)]) and fit[(1, 1)] == 1.0
    assert surface_drop(raw, (1, 2), (1, 2)) == pytest.approx(1 - 1.1 / 1.4)
    assert "cheaper" in profile_noise({"noise_drop": 0.5, "t1_spread": 1.0})
    assert profile_noise({"cost_drop": 0.5, "noise_drop": 0.0, "t1_spread": 1.0}) == ""  # a repeatable dip


# ------------------------------------------------------------------------------------------- bench --batch-sizes
def test_batch_figures_on_hand_made_runs():
    from specheads.infer.bench.batch import BatchRun, compare_runs

    van = [BatchRun("vanilla", 2, ["a", "b"], [[1, 2, 3], [4, 5]], 1.0, 3, 5)]
    plain = [BatchRun("plain", 2, ["a", "b"], [[1, 2, 3], [4, 5]], 2.0, 3, 5)]
    mine = [BatchRun("x", 2, ["a", "b"], [[1, 2, 3], [4, 6]], 0.5, 2, 4)]
    s = compare_runs(mine, van, plain, greedy=True)
    assert s["tokens_per_s"] == 10 and s["speedup"] == 2 and s["speedup_vs_plain"] == 4
    assert s["tau"] == 5 / 4 and s["identical"] == 0.5 and s["rows"] == 2
    assert s["vs_plain_chunks"] is None  # one chunk: no spread


def test_chunk_paired_ratio_against_plain():
    """Two chunks at 1.1x and 0.9x plain: geometric mean sqrt(0.99), standard error |log 1.1 - log 0.9| / 2;
    chunks are matched by their prompts, not by order."""
    import math

    from specheads.infer.bench.batch import BatchRun, paired_chunk_ratio

    plain = [BatchRun("plain", 1, ["a"], [[1] * 10], 1.0, 10, 10), BatchRun("plain", 1, ["b"], [[1] * 10], 2.0, 10, 10)]
    mine = [BatchRun("x", 1, ["b"], [[1] * 10], 2.0 / 0.9, 9, 9), BatchRun("x", 1, ["a"], [[1] * 10], 1.0 / 1.1, 9, 9)]
    c = paired_chunk_ratio(mine, plain)
    assert c["chunks"] == 2 and c["geomean"] == pytest.approx(math.sqrt(0.99))
    assert c["se_log"] == pytest.approx(abs(math.log(1.1) - math.log(0.9)) / 2)


def test_batch_sweep_on_the_tiny_target(tiny, tmp_path, monkeypatch):
    """vanilla, plain, prompt-lookup, prompt-lookup+sched, recycling+sched and an EAGLE-3 head+sched at B = 1, 2, 4
    on 5 prompts
    (the last chunk of B = 2 and 4 is short): every row of ours equals vanilla's (fp32 greedy), τ is 1.00 for vanilla and plain, the
    results files are written."""
    import json

    from specheads.infer.bench import MethodOptions
    from specheads.infer.bench.batch import BatchBenchSettings, build_batch_methods, run_batch_bench
    from specheads.infer.scheduling import profile

    real = profile.load_or_profile_batch
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(profile, "load_or_profile_batch", lambda target, refresh=False: real(
        target, refresh, rows=(1, 2), tokens=(1, 2), context=16, repeats=1))
    ps = [(f"p{i}", p) for i, p in enumerate(mixed_prompts(tiny.vocab_size, 6)[:5])]
    build_head(HeadSpec(kind="eagle3"), tiny).save_pretrained(tmp_path / "head")
    options = MethodOptions(heads={"head": str(tmp_path / "head")}, tree="2,2,4")
    names = ["plain", "prompt-lookup", "prompt-lookup+sched", "recycling+sched", "head+sched"]
    methods, extra = build_batch_methods(names, tiny, options)
    assert [m.name for m in methods] == ["vanilla"] + names
    assert extra["trees"]["head"]["reason"] == "given with --tree"
    settings = BatchBenchSettings("tiny", "hand-made", "float32", batch_sizes=[4, 1, 2], max_new_tokens=10)
    res = run_batch_bench(ps, methods, settings, out_dir=tmp_path / "out", extra=extra, progress=False)
    assert list(res["batch_sizes"]) == ["1", "2", "4"] and res["num_prompts"] == 5 and res["complete"]
    for b, per in res["batch_sizes"].items():
        assert per["vanilla"]["tau"] == 1.0 == per["plain"]["tau"] and per["vanilla"]["rows"] == 5
        assert all(per[n]["identical"] == 1.0 and per[n]["speedup"] > 0 for n in per), b
        assert per["vanilla"]["phase_seconds"] is None and per["plain"]["phase_seconds"]["target"] > 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["schema"] == "specheads.batchbench/1" and saved["cost_surface"]["batch"]["rows"] == [1, 2]
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| prompt-lookup+sched |" in md and "Against plain, chunk by chunk" in md
    assert per["prompt-lookup+sched"]["vs_plain_chunks"]["chunks"] >= 2
    assert (tmp_path / "out" / "speedup_batch.png").stat().st_size > 1000


def test_batch_sweep_takes_a_dspark_head_with_tree_auto(tiny, tmp_path, monkeypatch):
    """A DSpark head in the sweep with the default --tree auto: the whole block every step (no tree probe, which
    only tree heads have), +sched cutting it per row (--pricing profile); every row equals vanilla's (fp32 greedy)."""
    from specheads.infer.bench import MethodOptions
    from specheads.infer.bench.batch import BatchBenchSettings, build_batch_methods, run_batch_bench
    from specheads.infer.scheduling import profile

    real = profile.load_or_profile_batch
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(profile, "load_or_profile_batch", lambda target, refresh=False: real(
        target, refresh, rows=(1, 2), tokens=(1, 2), context=16, repeats=1))
    ps = [(f"p{i}", p) for i, p in enumerate(mixed_prompts(tiny.vocab_size, 6)[:3])]
    build_head(HeadSpec(kind="dspark", block_size=3), tiny).save_pretrained(tmp_path / "dspark")
    methods, extra = build_batch_methods(["head", "head+sched"], tiny, MethodOptions(
        heads={"head": str(tmp_path / "dspark")}, tree="auto", pricing="profile"))
    assert extra["trees"]["head"]["mode"] == "auto" and "block of 3 drafts" in extra["trees"]["head"]["summary"]
    # --pricing profile: the budget's drafting cost fixed at 0 (the cost surface alone), recorded
    assert methods[2].make_scheduler().draft_cost == 0.0 and extra["methods_info"]["head+sched"]["pricing"] == "profile"
    settings = BatchBenchSettings("tiny", "hand-made", "float32", batch_sizes=[1, 2], max_new_tokens=8)
    res = run_batch_bench(ps, methods, settings, out_dir=tmp_path / "out", extra=extra, progress=False)
    for per in res["batch_sizes"].values():
        assert per["head"]["identical"] == 1.0 == per["head+sched"]["identical"]


def test_cli_batch_sizes_checked_before_the_target_loads(tmp_path, monkeypatch, capsys):
    import specheads.target
    from specheads.cli import main

    def no_load(*a, **k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(specheads.target, "load_target", no_load)
    assert main(["bench", "--batch-sizes", "0,2", "--out", str(tmp_path)]) == 2
    assert "--batch-sizes 0,2" in capsys.readouterr().err
    assert main(["bench", "--batch-sizes", "1,2", "--methods", "vanilla,plain+sched", "--out", str(tmp_path)]) == 2
    assert "plain+sched" in capsys.readouterr().err
    assert main(["bench", "--batch-sizes", "1,x", "--out", str(tmp_path)]) == 2


def test_stop_strings_end_rows_as_alone(tiny):
    """A stop string (decoded with a toy tokenizer) ends each row where `generate` alone ends it."""
    from test_generate import CharTokenizer

    tiny.tokenizer = CharTokenizer()
    ps = mixed_prompts(tiny.vocab_size, 4, seed=4)
    stop = CharTokenizer().decode(hf_greedy(tiny, ps[1], 20))[6:8]
    res = generate_batch(tiny, lambda: PromptLookupDrafter(num_tokens=4), ps, 20, stop_strings=[stop],
                         ignore_eos=True)
    for i, p in enumerate(ps):
        alone = generate(tiny, PromptLookupDrafter(num_tokens=4), p, max_new_tokens=20, stop_strings=[stop],
                         ignore_eos=True)
        assert res.rows[i].ids == alone.ids and res.rows[i].stats.stop_reason == alone.stats.stop_reason
        assert res.rows[i].text == alone.text
    assert res.rows[1].stats.stop_reason == "stop_string"
