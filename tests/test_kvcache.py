"""engine/kvcache.py, each edit against transformers' own cache: the same tokens run through the model into a fresh
DynamicCache without our edits must give the same keys / values and the same logits of the next forward. On every
architecture the suite's tiny targets use: Llama (tiny_target) and Gemma 3 with sliding-window layers (mixed with a
full layer, and sliding only). The greedy verifier on the device path against a plain walk on random trees."""
import pytest
import torch

from specheads.infer.engine.kvcache import (buffered_cache, cache_columns, drop_tail, keep_accepted,
                                            keep_accepted_rows, merge_caches, new_batch_cache, prepare_cache,
                                            select_rows, tree_attention_mask)
from specheads.infer.tree import DraftTree
from specheads.infer.verify import greedy_on_device, verify_greedy
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


def test_left_padded_merge_and_leading_columns_equal_fresh_caches():
    """Regeneration's layout: right-aligned rows (left padding), merged left-padded, leading columns cut."""
    model = tiny_target().model
    a, b = [3, 4, 5, 6, 7, 8], [9, 10]

    def left_padded(rows):
        cache, _ = buffered_cache(model)
        T = max(len(r) for r in rows)
        ids, mask = torch.zeros(len(rows), T, dtype=torch.long), torch.zeros(len(rows), T, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, T - len(r):], mask[i, T - len(r):] = torch.tensor(r), 1
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), cache=cache,
                  use_cache=True)
        return cache

    cache = left_padded([a])
    merge_caches(cache, left_padded([b]), 1, 1, left_padded=True)
    select_rows(cache, [1], start=4)  # b alone: its 2 columns are the last 2 of 6
    ref = fresh(model, b)
    for layer, rl in zip(cache.layers, ref.layers):
        torch.testing.assert_close(layer.keys, rl.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(layer.values, rl.values, atol=ATOL, rtol=0)
    with torch.no_grad():  # the buffered layer writes the next column in place
        got = model(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[2]]), cache=cache,
                    use_cache=True).logits[0, -1]
        want = model(input_ids=torch.tensor([b + [5]])).logits[0, -1]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


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
