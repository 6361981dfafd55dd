"""specheads/kvcache.py, each edit against transformers' own cache: the same tokens run through the model into a fresh
DynamicCache without our edits must give the same keys / values and the same logits of the next forward. On every
architecture the suite's tiny targets use: Llama (tiny_target) and Gemma 3 with sliding-window layers (mixed with a
full layer, and sliding only). The greedy verifier on the device path (one tree, and a batch of padded trees) against
a plain walk on random trees."""
import pytest
import torch

from specheads.kvcache import (buffered_cache, cache_columns, drop_tail, keep_accepted,
                                            keep_accepted_rows, merge_caches, new_batch_cache, prepare_cache,
                                            select_rows, tree_attention_mask)
from specheads.infer.tree import DraftTree
from specheads.infer import verify as verify_mod
from specheads.infer.verify import greedy_batch_on_device, greedy_on_device, verify_greedy, verify_rows
from specheads.target import Target, tiny_target
from specheads.utils import SpecheadsError

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-5  # fp32, different matmul shapes


def gemma(layer_types, seed=0):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                           layer_types=layer_types, max_position_embeddings=512, attn_implementation="eager")
    return Target(Gemma3ForCausalLM(cfg).eval().requires_grad_(False), None, "tiny-gemma3")


TARGETS = {"llama": lambda: tiny_target(),
           "gemma3-mixed": lambda: gemma(["sliding_attention"] * 3 + ["full_attention"]),
           "gemma3-sliding": lambda: gemma(["sliding_attention"] * 2)}


@pytest.fixture(params=list(TARGETS), scope="module")
def target(request):
    return TARGETS[request.param]()


def fresh(model, ids: list[int]):
    """transformers' own cache of `ids` (no edits of ours)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    return cache


def next_logits(model, cache, length: int, token: int = 5) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[length]]), cache=cache,
                     use_cache=True).logits[0, -1]


def assert_same_cache(model, ours, ref, length: int) -> None:
    """Same visible keys / values per layer, same length, and the same logits of the next forward."""
    assert ours.get_seq_length() == ref.get_seq_length() == length
    for a, b in zip(ours.layers, ref.layers):
        assert a.keys.shape == b.keys.shape
        torch.testing.assert_close(a.keys, b.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(a.values, b.values, atol=ATOL, rtol=0)
    torch.testing.assert_close(next_logits(model, ours, length), next_logits(model, ref, length), atol=ATOL, rtol=0)


def tree_step(target, prefix: list[int]):
    """A prefix cached, then one tree forward over it (the generator's order of edits) -> (cache, tree)."""
    from transformers import DynamicCache

    model = target.model
    g = torch.Generator().manual_seed(len(prefix))
    tree = DraftTree(torch.randint(3, 256, (7,), generator=g), [-1, 0, 0, 1, 1, 3, 2], [0, 1, 1, 2, 2, 3, 2])
    cache = DynamicCache(config=model.config)
    prepare_cache(cache)
    n = len(prefix)
    with torch.no_grad():
        model(input_ids=torch.tensor([prefix]), position_ids=torch.arange(n)[None], cache=cache, use_cache=True)
        mask = tree_attention_mask(tree, cache, n, target.dtype)
        out = model(input_ids=tree.tokens[None], attention_mask=mask, position_ids=tree.position_ids(n),
                    cache=cache, use_cache=True).logits[0]
    return cache, tree, out


@pytest.mark.parametrize("n_prefix", [3, 12])  # shorter and longer than the sliding window (8)
@pytest.mark.parametrize("keep", [[0], [0, 1, 3], [0, 2, 6], [0, 1, 3, 5]])
def test_keep_accepted_equals_a_fresh_cache(target, n_prefix, keep):
    prefix = list(range(10, 10 + n_prefix))
    cache, tree, logits = tree_step(target, prefix)
    for i in range(len(tree)):  # the tree mask: node i sees exactly its path
        seq = prefix + tree.tokens[tree.path(i)].tolist()
        with torch.no_grad():
            ref = target.model(input_ids=torch.tensor([seq])).logits[0, -1]
        torch.testing.assert_close(logits[i], ref, atol=ATOL, rtol=0)
    keep_accepted(cache, len(tree), keep)
    seq = prefix + tree.tokens[keep].tolist()
    assert_same_cache(target.model, cache, fresh(target.model, seq), len(seq))


def test_drop_tail_equals_a_fresh_cache(target):
    """A chain of 5 forwarded and its last 3 dropped (a drafter's rewind) == the first 2 cached fresh."""
    from transformers import DynamicCache

    model, ids = target.model, list(range(20, 32))
    cache = DynamicCache(config=model.config)
    prepare_cache(cache)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids[:7]]), cache=cache, use_cache=True)
        model(input_ids=torch.tensor([ids[7:]]), position_ids=torch.arange(7, 12)[None], cache=cache, use_cache=True)
    drop_tail(cache, 3)
    drop_tail(cache, 0)  # nothing
    assert_same_cache(model, cache, fresh(model, ids[:9]), 9)


def rows_forward(model, cache, rows: list[list[int]], cols: int, n: int):
    """One forward of n tokens per row over a left-aligned batch cache of `cols` columns (row r's length
    len(rows[r]) - n): the batched loop's layout, a chain per row. Returns logits [B, n, V]."""
    B = len(rows)
    lengths = [len(r) - n for r in rows]
    allowed = torch.zeros(B, n, cols + n, dtype=torch.bool)
    for b, length in enumerate(lengths):
        allowed[b, :, :length] = True
    allowed[:, :, cols:] = torch.ones(n, n, dtype=torch.bool).tril()
    mask = torch.zeros(B, 1, n, cols + n).masked_fill_(~allowed[:, None], float("-inf"))
    ids = torch.tensor([r[-n:] for r in rows])
    pos = torch.tensor([[length + j for j in range(n)] for length in lengths])
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True).logits


def prefill_rows(model, rows: list[list[int]]):
    """A batch cache of right-padded rows (the batched loop's join)."""
    cache = new_batch_cache(model)
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r)
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.arange(T).repeat(len(rows), 1), cache=cache, use_cache=True)
    return cache


def assert_rows(model, cache, rows: list[list[int]]) -> None:
    """Each row's first len(row) columns equal a fresh single-row cache of it; the next forward (one token per
    row, through the whole batch) gives each row the logits of its fresh cache."""
    cols = cache_columns(cache)
    for b, r in enumerate(rows):
        ref = fresh(model, r)
        for layer, rl in zip(cache.layers, ref.layers):
            torch.testing.assert_close(layer.keys[b:b + 1, :, :len(r)], rl.keys, atol=ATOL, rtol=0)
            torch.testing.assert_close(layer.values[b:b + 1, :, :len(r)], rl.values, atol=ATOL, rtol=0)
    got = rows_forward(model, cache, [r + [5] for r in rows], cols, 1)[:, -1]
    for b, r in enumerate(rows):
        with torch.no_grad():
            want = model(input_ids=torch.tensor([r + [5]])).logits[0, -1]
        torch.testing.assert_close(got[b], want, atol=ATOL, rtol=0)


def test_batch_edits_equal_fresh_caches():
    """The batched loop's edits on the tiny Llama: rows joining (merge_caches, right padding), a tree step's
    accepted nodes per row (keep_accepted_rows), rows leaving (select_rows), each row against its own fresh cache,
    and the buffered layers writing in place after each edit."""
    target = tiny_target()
    model = target.model
    rows = [[3, 4, 5, 6, 7], [8, 9]]
    cache = prefill_rows(model, rows)
    joining = [[10, 11, 12, 13, 14, 15, 16], [17, 18, 19]]
    merge_caches(cache, prefill_rows(model, joining), 2, 2)
    rows += joining
    assert_rows(model, cache, rows)
    # a chain of 3 nodes per row: rows keep 1, 3, 2 and 1 of them
    cols = cache_columns(cache)
    drafts = [[20, 21, 22], [23, 24, 25], [26, 27, 28], [29, 30, 31]]
    rows_forward(model, cache, [r + d for r, d in zip(rows, drafts)], cols, 3)
    accepted = [[0], [0, 1, 2], [0, 1], [0]]
    new = keep_accepted_rows(cache, cols, [len(r) for r in rows], accepted)
    rows = [r + d[:len(a)] for r, d, a in zip(rows, drafts, accepted)]
    assert new == [len(r) for r in rows] and cache_columns(cache) == max(new)
    assert_rows(model, cache, rows)
    keep = [1, 3]
    select_rows(cache, keep, max(len(rows[i]) for i in keep))
    rows = [rows[i] for i in keep]
    assert cache_columns(cache) == max(len(r) for r in rows)
    assert_rows(model, cache, rows)


def test_buffered_layer_writes_in_place_and_keeps_a_cut_tail():
    model = tiny_target().model
    cache = new_batch_cache(model)
    with torch.no_grad():
        model(input_ids=torch.tensor([[3, 4, 5]]), cache=cache, use_cache=True)
        buf = cache.layers[0].buf_k.data_ptr()
        model(input_ids=torch.tensor([[6, 7]]), position_ids=torch.tensor([[3, 4]]), cache=cache, use_cache=True)
        assert cache.layers[0].buf_k.data_ptr() == buf and cache_columns(cache) == 5  # no copy of the cache
        drop_tail(cache, 2)
        got = model(input_ids=torch.tensor([[8]]), position_ids=torch.tensor([[3]]), cache=cache,
                    use_cache=True).logits[0, -1]
        assert cache.layers[0].buf_k.data_ptr() == buf  # the cut tail is written over
        want = model(input_ids=torch.tensor([[3, 4, 5, 8]])).logits[0, -1]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_sliding_window_batch_cache_is_refused():
    target = gemma(["sliding_attention", "full_attention"])
    assert buffered_cache(target.model)[1] is False
    with pytest.raises(SpecheadsError, match="sliding-window"):
        new_batch_cache(target.model)


# ------------------------------------------------------------------------------------------------ verification
def reference_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """The walk, spelled out: from the root take the first child (index order) equal to the argmax; stop at none."""
    nodes = [0]
    while True:
        best = int(torch.argmax(logits[nodes[-1]].float()))
        kids = [i for i in range(len(tree)) if int(tree.parents[i]) == nodes[-1] and int(tree.tokens[i]) == best]
        if not kids:
            return nodes, best
        nodes.append(kids[0])


def random_tree(g: torch.Generator, n: int, vocab: int) -> DraftTree:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    return DraftTree(torch.randint(0, vocab, (n,), generator=g), parents, depth)


@pytest.mark.parametrize("vocab", [3, 8])  # 3: siblings often repeat a token and logits tie
def test_device_greedy_equals_the_walk_on_random_trees(vocab):
    g = torch.Generator().manual_seed(vocab)
    for trial in range(300):
        tree = random_tree(g, int(torch.randint(1, 24, (1,), generator=g)), vocab)
        logits = torch.randint(0, 3, (len(tree), vocab), generator=g).float()  # few values: ties
        if trial % 3 == 0:  # a target that mostly agrees with the drafts (long accepted paths)
            logits[tree.parents[1:], tree.tokens[1:]] += 5
        want = reference_greedy(tree, logits)
        for fn in (greedy_on_device, verify_greedy):
            acc = fn(tree, logits)
            assert (acc.nodes, acc.bonus) == want, (fn.__name__, tree, logits)
        acc = greedy_on_device(tree, logits.to(torch.bfloat16))
        assert (acc.nodes, acc.bonus) == want


def _onehot(rows: list[list[int]], n: int, vocab: int = 10) -> torch.Tensor:
    """rows[r][i]: the target's argmax after node i of row r -> [B, n, vocab] logits; missing nodes (padding) put
    their argmax on token 0."""
    lg = torch.zeros(len(rows), n, vocab)
    for r, row in enumerate(rows):
        for i, tok in enumerate(row):
            lg[r, i, tok] = 10.0
    return lg


def test_batched_device_greedy_by_hand():
    """Three rows padded to 5 nodes: a branch taken second, equal sibling tokens (the walk takes the first even when
    the second leads deeper), a root alone; each row's (nodes, bonus) written out."""
    branch = DraftTree([1, 2, 3, 4, 5], [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2])  # root -> a(2) -> c(4); root -> b(3) -> d(5)
    twins = DraftTree([7, 5, 5, 6], [-1, 0, 0, 2], [0, 1, 1, 2])  # root -> 5; root -> 5 -> 6
    root = DraftTree([9], [-1], [0])
    logits = _onehot([[3, 4, 6, 0, 0], [5, 6, 6, 1], [4]], 5)
    got = [(a.nodes, a.bonus) for a in greedy_batch_on_device([branch, twins, root], logits)]
    assert got == [([0, 2], 6), ([0, 1], 6), ([0], 4)]
    assert got == [(a.nodes, a.bonus) for a in (verify_greedy(t, logits[r, :len(t)])
                                               for r, t in enumerate([branch, twins, root]))]


@pytest.mark.parametrize("vocab", [3, 8])  # 3: siblings often repeat a token and logits tie
def test_batched_device_greedy_equals_each_row_walk(vocab):
    """greedy_batch_on_device (the accelerator path, run on CPU tensors) over B random trees of different sizes,
    padded to N (sometimes wider than the largest), equals verify_greedy of each row alone, fp32 and bf16."""
    g = torch.Generator().manual_seed(100 + vocab)
    for trial in range(80):
        B = int(torch.randint(1, 6, (1,), generator=g))
        trees = [random_tree(g, int(torch.randint(1, 20, (1,), generator=g)), vocab) for _ in range(B)]
        N = max(map(len, trees)) + int(torch.randint(0, 3, (1,), generator=g))
        logits = torch.randint(0, 3, (B, N, vocab), generator=g).float()  # few values: ties
        for r, t in enumerate(trees):
            if (trial + r) % 3 == 0:  # a target that mostly agrees with this row's drafts (long paths)
                logits[r, t.parents[1:], t.tokens[1:]] += 5
        want = [(a.nodes, a.bonus) for a in (verify_greedy(t, logits[r, :len(t)]) for r, t in enumerate(trees))]
        assert want == [reference_greedy(t, logits[r, :len(t)]) for r, t in enumerate(trees)]
        for lg in (logits, logits.to(torch.bfloat16)):
            assert [(a.nodes, a.bonus) for a in greedy_batch_on_device(trees, lg)] == want, (trial, trees)


def test_verify_rows_on_the_host_walks_each_row(monkeypatch):
    """Host logits: each row's own rule (verify_greedy's walk), never the batched tensor path."""
    calls = []
    monkeypatch.setattr(verify_mod, "greedy_batch_on_device", lambda *a: calls.append(a))
    trees = [DraftTree([1, 2], [-1, 0], [0, 1]), DraftTree([3], [-1], [0])]
    accs = verify_rows([verify_greedy, verify_greedy], trees, _onehot([[2, 7], [5]], 2))
    assert [(a.nodes, a.bonus) for a in accs] == [([0, 1], 7), ([0], 5)] and not calls
