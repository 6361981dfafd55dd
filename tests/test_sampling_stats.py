"""Lossless sampling: what verification emits is distributed as the target's own sampling distribution.

Cheap form: one verify-and-emit step on a tiny vocabulary (V = 8) with exact target probabilities given by a Markov
table (the target's next-token distribution depends on the last token only), a tree with several children and
depths, >= 10,000 samples, chi-square against the exact joint distribution of the first two emitted tokens
(p > 0.001). Plus a small end-to-end run through generate() with a real draft model.
"""
import pytest
import torch
from scipy.stats import chisquare

from specheads.infer.tree import DraftTree
from specheads.infer.verify import SamplingParams, target_probs, verify_sampling
from helpers import perturb, sampled_pairs, two_token_probs

V = 8
SAMPLES = 10_000


# Small sequential forwards: one intra-op thread is several times faster than two on a shared CPU.
pytestmark = pytest.mark.usefixtures("one_thread")


def markov_logits(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g) * 1.5  # [V, V]: logits of the next token after token x (row x)


def draw_tree(root, q_table, shape, g, deterministic):
    """A tree of `shape` (children per node, level by level), children drawn WITHOUT replacement from the draft's
    distribution q_table[token] (or, deterministic, the top tokens of it: point masses)."""
    tokens, parents, depth = [root], [-1], [0]
    level = [0]
    for width in shape:
        nxt = []
        for node in level:
            q = q_table[tokens[node]]
            kids = q.topk(width).indices if deterministic else torch.multinomial(q, width, replacement=False, generator=g)
            for x in kids.tolist():
                tokens.append(x)
                parents.append(node)
                depth.append(depth[node] + 1)
                nxt.append(len(tokens) - 1)
        level = nxt[:2]  # expand at most two nodes per level: an irregular tree
    q = None if deterministic else torch.stack([q_table[t] for t in tokens])
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depth), q)


def joint_counts(logits_table, sampling, deterministic, seed):
    g = torch.Generator().manual_seed(seed)
    p_table = target_probs(logits_table, sampling)  # [V, V] the target's own sampling distribution
    q_table = torch.softmax(markov_logits(seed=7) * 0.8, -1)  # a different (draft) distribution
    root = 3
    counts = torch.zeros(V, V)
    for _ in range(SAMPLES):
        tree = draw_tree(root, q_table, (3, 2, 2), g, deterministic)
        probs = p_table[tree.tokens]  # [N, V]: node i's target distribution depends on its own token only
        acc = verify_sampling(tree, None, sampling, g, probs=probs)
        emitted = [int(tree.tokens[i]) for i in acc.nodes[1:]] + [acc.bonus]
        if len(emitted) == 1:  # the next step would start from the bonus; its first token is drawn from p
            emitted.append(int(torch.multinomial(p_table[emitted[0]], 1, generator=g)))
        counts[emitted[0], emitted[1]] += 1
    expected = p_table[root][:, None] * p_table  # P(x1) P(x2 | x1)
    return counts.flatten(), expected.flatten() * SAMPLES


def assert_same(counts, expected):
    keep = expected > 5  # chi-square needs enough expected mass per cell; the rest must be (near) empty
    assert counts[expected == 0].sum() == 0  # never a token the target could not sample (e.g. cut by top-p)
    obs, exp = counts[keep], expected[keep]
    if expected[~keep].sum() > 0:  # the sparse cells pooled into one
        obs = torch.cat([obs, counts[~keep].sum()[None]])
        exp = torch.cat([exp, expected[~keep].sum()[None]])
    exp = exp * obs.sum() / exp.sum()
    p = chisquare(obs.numpy(), exp.numpy()).pvalue
    assert p > 1e-3, p


@pytest.mark.parametrize("deterministic", [False, True], ids=["q-sampled", "point-mass"])
def test_one_step_temperature_1(deterministic):
    assert_same(*joint_counts(markov_logits(), SamplingParams(temperature=1.0), deterministic, seed=1))


def test_one_step_top_p_temperature():
    sampling = SamplingParams(temperature=0.7, top_p=0.8)
    counts, expected = joint_counts(markov_logits(), sampling, deterministic=False, seed=2)
    assert (expected == 0).sum() > 0  # top-p really removed tokens
    assert_same(counts, expected)


def test_end_to_end_draft_model_sampling():
    """generate() with a draft model (q recorded) on an 8-token vocabulary: first two new tokens vs the exact
    target distribution computed by two full forwards."""
    from specheads.infer.drafters import DraftModelDrafter
    from specheads.target import tiny_target

    target = tiny_target(vocab_size=V, hidden_size=32, num_layers=2, seed=0)
    draft = tiny_target(vocab_size=V, hidden_size=32, num_layers=1, seed=1)
    prompt = [1, 5, 3]
    expected = two_token_probs(target, prompt, SamplingParams(temperature=1.0, top_k=4))
    n = 600  # generate() runs a few tiny forwards each: kept small; the one-step tests carry the 10k samples
    counts, _ = sampled_pairs(target, DraftModelDrafter(draft.model, num_tokens=2), prompt, n, top_k=4)
    assert_same(counts, expected * n)


# the DSpark drafter's variants: its Markov heads (vanilla, rnn), Domino's GRU and P-EAGLE's depths riding it;
# the other block kinds' lossless sampling is in their own test files (LiLiCorr has none yet)
@pytest.mark.parametrize("markov", ["vanilla", "rnn", "domino", "peagle"])
def test_end_to_end_dspark_block_sampling(markov):
    """generate() with a DSpark block drafter (each draft drawn from its warped block distribution, the next draft's
    Markov bias reading the drawn token, q recorded; its own scheduler choosing the prefix) on an 8-token
    vocabulary: first two new tokens vs the exact target distribution. P-EAGLE rides the same block drafter (its
    drafts read no drawn token)."""
    from specheads.heads.base import HeadSpec, build_head
    from specheads.infer.drafters import DSparkDrafter, PEagleDrafter
    from specheads.infer.scheduling.step import Scheduler
    from specheads.target import tiny_target

    target = tiny_target(vocab_size=V, hidden_size=32, num_layers=2, seed=0)
    torch.manual_seed(1)
    spec = HeadSpec(kind="domino", feature_layers=[1, 2], block_size=3, markov_rank=0, num_layers=1,
                    confidence_head=False, domino_gru_hidden=8, domino_emb_dim=4, domino_prefix_len=0) \
        if markov == "domino" else HeadSpec(kind="peagle", feature_layers=[1, 2], num_layers=2, num_depths=3) \
        if markov == "peagle" else HeadSpec(kind="dspark", feature_layers=[1, 2], block_size=3, markov_rank=4,
                                            num_layers=1, markov_head_type=markov)
    head = build_head(spec, target).eval()  # domino: the GRU reads the drawn drafts as the Markov bias does
    perturb(head, 0.5, seed=None, trainable_only=True)  # a draft that differs from the target (and from uniform)
    prompt = [1, 5, 3]
    expected = two_token_probs(target, prompt, SamplingParams(temperature=1.0, top_k=4))
    n = 600
    drafter = DSparkDrafter(head, num_tokens=2) if markov == "vanilla" else \
        PEagleDrafter(head, scheduler=Scheduler({1: 1.0, 2: 1.01, 4: 1.02}, 1.0)) if markov == "peagle" else \
        DSparkDrafter(head, scheduler=Scheduler({1: 1.0, 2: 1.01, 4: 1.02}, 1.0))  # t(1) 1 s: drafting is free
    counts, drafted = sampled_pairs(target, drafter, prompt, n, top_k=4)
    assert drafted > n  # drafts were proposed (and verified) on most steps
    assert_same(counts, expected * n)
