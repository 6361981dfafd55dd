"""Verification rules on hand-written logits, and the one-forward tree pass against sequential decoding."""
import pytest
import torch

from specheads.kvcache import keep_accepted, prepare_cache
from specheads.infer.tree import DraftTree
from specheads.infer.verify import (SamplingParams, target_probs, verify_greedy, verify_sampling,
                                    verify_typical_lossy)

V = 8


# Small sequential forwards: one intra-op thread is several times faster than two on a shared CPU.
pytestmark = pytest.mark.usefixtures("one_thread")



def onehot_logits(rows):
    """rows: the target's argmax token after each node -> [N, V] logits (10 on it, 0 elsewhere)."""
    lg = torch.zeros(len(rows), V)
    for i, r in enumerate(rows):
        lg[i, r] = 10.0
    return lg


def tree():
    # root(1) -> a(2) -> c(4)
    #         -> b(3) -> d(5)
    return DraftTree([1, 2, 3, 4, 5], [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2])


def test_greedy_never_accepts():
    acc = verify_greedy(tree(), onehot_logits([7, 0, 0, 0, 0]))
    assert acc.nodes == [0] and acc.bonus == 7


def test_greedy_always_accepts_full_path():
    acc = verify_greedy(tree(), onehot_logits([3, 0, 5, 0, 0]))  # root->b matches, b->d matches, then bonus 6? no:
    assert acc.nodes == [0, 2, 4] and acc.bonus == 0


def test_greedy_partial_path_second_branch():
    acc = verify_greedy(tree(), onehot_logits([3, 4, 6, 0, 0]))  # b accepted, d rejected (target says 6)
    assert acc.nodes == [0, 2] and acc.bonus == 6


def log_probs(rows):
    return torch.log(torch.tensor(rows, dtype=torch.float32).clamp_min(1e-30))


def test_sampling_point_mass_always_and_never():
    g = torch.Generator().manual_seed(0)
    always = torch.zeros(5, V)
    always[0, 2] = always[1, 4] = always[3, 6] = 1.0  # target is certain of root->a->c->6
    always[2, 0] = always[4, 0] = 1.0
    for _ in range(20):
        acc = verify_sampling(tree(), log_probs(always.tolist()), SamplingParams(temperature=1.0), g)
        assert acc.nodes == [0, 1, 3] and acc.bonus == 6
    never = torch.full((5, V), 1.0 / 6)
    never[0, 2] = never[0, 3] = 0.0  # the target never produces either child of the root
    for _ in range(20):
        acc = verify_sampling(tree(), log_probs(never.tolist()), SamplingParams(temperature=1.0), g)
        assert acc.nodes == [0] and acc.bonus not in (2, 3)


def test_sampling_with_q_residual_excludes_rejected_token():
    g = torch.Generator().manual_seed(0)
    t = DraftTree([1, 2], [-1, 0], [0, 1], q=torch.tensor([[0, 0, 1.0, 0, 0, 0, 0, 0]] * 2))
    p = torch.tensor([[0, 0, 0.5, 0.5, 0, 0, 0, 0], [1.0] + [0] * 7])
    seen = {"acc": 0, "rej": 0}
    for _ in range(400):
        acc = verify_sampling(t, log_probs(p.tolist()), SamplingParams(temperature=1.0), g)
        if acc.nodes == [0, 1]:
            seen["acc"] += 1
            assert acc.bonus == 0
        else:
            seen["rej"] += 1
            assert acc.bonus == 3  # residual max(p - q, 0) has all its mass on token 3
    assert 150 < seen["acc"] < 250  # min(1, p/q) = 0.5


def test_target_probs_matches_hf_warpers_order():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]])
    p = target_probs(logits, SamplingParams(temperature=0.5, top_p=0.9, top_k=3))
    assert p[0, 3:].sum() == 0  # top-k 3 cut
    ref = torch.softmax(logits / 0.5, -1)[0, :3]
    ref = ref / ref.sum()  # top-p 0.9 keeps the first two? 0.867+0.117 > 0.9 -> both kept, third dropped
    keep = (ref.cumsum(0) - ref) < 0.9
    ref = torch.where(keep, ref, 0) / ref[keep].sum()
    assert torch.allclose(p[0, :3], ref, atol=1e-6)


def test_typical_is_lossy_threshold():
    lg = log_probs([[0.01, 0.01, 0.9, 0.02, 0.02, 0.02, 0.01, 0.01]] + [[1 / V] * V] * 4)
    acc = verify_typical_lossy(tree(), lg, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert acc.nodes[:2] == [0, 1]  # token 2 at 0.9 passes; token 3 at 0.02 would not
    lg2 = log_probs([[0.01, 0.01, 0.02, 0.9, 0.02, 0.02, 0.01, 0.01]] + [[1 / V] * V] * 4)
    acc2 = verify_typical_lossy(tree(), lg2, SamplingParams(temperature=0.0))
    assert acc2.nodes[:2] == [0, 2]


# ---------------------------------------------------------------------------------------------------------------
# One target forward over a tree == sequential decoding of every node's path; the pruned cache == a fresh prefill.
# ---------------------------------------------------------------------------------------------------------------

def check_tree_forward(target, atol):
    from transformers import DynamicCache

    model = target.model
    V_ = target.vocab_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, V_, (9,), generator=g).tolist()
    t = DraftTree(torch.randint(3, V_, (7,), generator=g), [-1, 0, 0, 1, 1, 3, 2], [0, 1, 1, 2, 2, 3, 2])
    cache = DynamicCache(config=model.config)
    prepare_cache(cache)
    model(input_ids=torch.tensor([prefix]), position_ids=torch.arange(9)[None], cache=cache, use_cache=True)
    out = model(input_ids=t.tokens[None], attention_mask=t.attention_mask(9, dtype=target.dtype),
                position_ids=t.position_ids(9), cache=cache, use_cache=True)
    for i in range(len(t)):
        seq = prefix + t.tokens[t.path(i)].tolist()
        ref = model(input_ids=torch.tensor([seq])).logits[0, -1]
        torch.testing.assert_close(out.logits[0, i], ref, atol=atol, rtol=0)
    # keep root -> 1 -> 3 -> 5 and compare the cache with a fresh prefill of that sequence
    keep = [0, 1, 3, 5]
    keep_accepted(cache, len(t), keep)
    seq = prefix + t.tokens[keep].tolist()
    fresh = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([seq]), cache=fresh, use_cache=True)
    assert cache.get_seq_length() == len(seq)
    for a, b in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=atol, rtol=0)
        torch.testing.assert_close(a.values, b.values, atol=atol, rtol=0)
    # and decoding on from the pruned cache matches decoding from the fresh prefix
    nxt = torch.tensor([[5]])
    a = model(input_ids=nxt, position_ids=torch.tensor([[len(seq)]]), cache=cache, use_cache=True).logits[0, -1]
    b = model(input_ids=torch.tensor([seq + [5]])).logits[0, -1]
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


def test_tree_forward_equals_sequential_tiny(tiny):
    check_tree_forward(tiny, atol=1e-5)  # fp32, different matmul shapes: agreement to 1e-5 absolute on logits


@pytest.mark.slow
def test_tree_forward_equals_sequential_smollm2(smollm2):
    check_tree_forward(smollm2, atol=1e-3)  # fp32 logits of magnitude ~20: 1e-3 absolute


def test_greedy_reads_only_path_rows_and_breaks_ties_like_hf():
    # root(1) -> a(2) -> c(4); root -> b(3) -> d(5). bf16 logits with a tie at the root between 2 and 3: HF's greedy
    # (fp32 argmax) takes the first index, 2. Rows off the walked path (b, d) are NaN: they must never be read.
    lg = onehot_logits([2, 4, 0, 6, 0]).to(torch.bfloat16)
    lg[0, 3] = 10.0
    lg[2] = float("nan")
    lg[4] = float("nan")
    acc = verify_greedy(tree(), lg)
    assert acc.nodes == [0, 1, 3] and acc.bonus == 6


def test_sampling_lazy_rows_equal_precomputed_probs():
    g = torch.Generator().manual_seed(0)
    lg = torch.randn(5, V, generator=g) * 2
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=5)
    for seed in range(20):
        a = verify_sampling(tree(), lg, sp, torch.Generator().manual_seed(seed))
        b = verify_sampling(tree(), lg, sp, torch.Generator().manual_seed(seed), probs=target_probs(lg, sp))
        assert (a.nodes, a.bonus) == (b.nodes, b.bonus)


@pytest.mark.parametrize("keep", [[0, 1, 2], [0, 2, 4], [0], [0, 3]])
def test_keep_accepted_equals_index_select(keep):
    from transformers import DynamicCache

    from specheads.target import tiny_target

    model = tiny_target().model
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.arange(3, 14)[None], cache=cache, use_cache=True)  # 6 prefix + 5 "tree" entries
    n_old, idx = 6, torch.tensor([0, 1, 2, 3, 4, 5] + [6 + k for k in keep])
    ref = [(l.keys.index_select(-2, idx).clone(), l.values.index_select(-2, idx).clone()) for l in cache.layers]
    keep_accepted(cache, 5, keep)
    assert cache.get_seq_length() == n_old + len(keep)
    for layer, (k, v) in zip(cache.layers, ref):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
