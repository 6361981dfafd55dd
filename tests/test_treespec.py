"""One tree spec and one parser for `generate --tree` and `bench --tree`: every form, every bound, and one clear
message for each bad input (named flag, reason, accepted forms; never a traceback, never an allocation)."""
import math

import pytest

from specheads.infer.drafters import parse_tree, tree_limits
from specheads.infer.tree import DEFAULT_MEDUSA_CHOICES
from specheads.infer.treespec import MAX_TREE_NODES, TreeLimits, TreeSpec, parse_tree_spec
from specheads.infer.verify import SamplingParams
from specheads.utils import SpecheadsError

SMOL = TreeLimits(max_rank=49152)  # a head over SmolLM2's full vocabulary


def test_dynamic_spec_is_depth_top_k_total():
    s = parse_tree_spec("2,4,8", "dynamic", limits=SMOL)
    assert (s.mode, s.depth, s.top_k, s.total_tokens) == ("dynamic", 2, 4, 8)  # the order both commands take
    assert s.summary() == "EAGLE-2 dynamic tree, 8 nodes, depth 2, top-k 4" and s.text == "2,4,8"
    # rank paths for an EAGLE head: the dynamic tree of their depth, widest rank and size
    assert parse_tree_spec("chain:3", "dynamic") == TreeSpec.dynamic(3, 1, 3, text="chain:3")
    j = parse_tree_spec("[[0], [1], [0, 0]]", "dynamic")
    assert (j.depth, j.top_k, j.total_tokens) == (2, 2, 3)
    assert parse_tree_spec(" auto ", "dynamic").mode == "auto"


def test_static_and_tokens_specs():
    s = parse_tree_spec("[[0, 1]]", "static")
    assert s.mode == "static" and s.choices == ((0,), (0, 1))  # the missing prefix is added
    assert parse_tree_spec("chain:2", "static").choices == ((0,), (0, 0))
    assert [list(c) for c in parse_tree_spec("default", "static").choices] == \
        sorted(DEFAULT_MEDUSA_CHOICES, key=lambda c: (len(c), c))
    assert parse_tree_spec("auto", "static").mode == "auto"
    assert parse_tree_spec("8", "tokens") == TreeSpec.tokens(8)


BAD = [  # (text, family, limits, reason in the message)
    ("3,100000,10", "dynamic", SMOL, "TOP_K 100000 is above the head's draft vocabulary of 49152 tokens"),
    ("3,100,10", "dynamic", SMOL, "TOP_K 100 is above the limit of 64 children per node"),
    ("0,0,0", "dynamic", SMOL, "DEPTH 0 is outside 1..64"),
    ("-1,8,48", "dynamic", SMOL, "DEPTH -1 is outside 1..64"),
    ("3,0,10", "dynamic", SMOL, "TOP_K 0 must be at least 1"),
    ("3,8,0", "dynamic", SMOL, "TOTAL (draft nodes) 0 is outside 1..1024"),
    ("3,8,5000", "dynamic", SMOL, "TOTAL (draft nodes) 5000 is outside 1..1024"),
    ("100,8,48", "dynamic", SMOL, "DEPTH 100 is outside 1..64"),
    ("a,b,c", "dynamic", SMOL, "expected three whole numbers DEPTH,TOP_K,TOTAL"),
    ("wide", "dynamic", SMOL, "not a tree spec"),
    ("chain:0", "static", SMOL, "the chain length K 0 is outside 1..64"),
    ("chain:x", "static", SMOL, "expected chain:K with K a whole number"),
    ("[[100000]]", "static", SMOL, "rank 100000 is beyond the head's draft vocabulary of 49152 tokens"),
    ("[[70]]", "static", SMOL, "rank 70 is above the limit of ranks 0..63"),
    ("[[0, -1]]", "static", SMOL, "ranks must be whole numbers >= 0"),
    ("[[0.5]]", "static", SMOL, "ranks must be whole numbers >= 0"),
    ("[]", "static", SMOL, "expected a non-empty JSON list"),
    ("[[]]", "static", SMOL, "expected a non-empty JSON list"),
    ("3,4,8", "static", SMOL, "not a tree spec"),
    (str([[0]] * (MAX_TREE_NODES + 1)), "static", SMOL, "1025 rank paths are above the limit of 1024"),
    ("[" + ",".join(f"[{r}, {c}]" for r in range(34) for c in range(30)) + "]", "static", TreeLimits(),
     "1054 draft nodes (with the paths' prefixes) are above the limit of 1024"),
    ("0", "tokens", TreeLimits(), "the number of draft tokens 0 is outside 1..64"),
    ("-3", "tokens", TreeLimits(), "the number of draft tokens -3 is outside 1..64"),
    ("wide", "tokens", TreeLimits(), "expected a whole number of tokens"),
    ("auto", "tokens", TreeLimits(), "automatic tree choice is for heads that draft trees"),
    ("4", "none", TreeLimits(), "plain decoding drafts nothing"),
]


@pytest.mark.parametrize("text,family,limits,why", BAD, ids=[f"{f}:{t[:20]}" for t, f, _, _ in BAD])
def test_bad_specs_are_one_clear_error(text, family, limits, why):
    with pytest.raises(SpecheadsError) as e:
        parse_tree_spec(text, family, drafter="the drafter", limits=limits)
    msg = str(e.value)
    assert msg.startswith(f"--tree {text if len(text) <= 60 else text[:57] + '...'}: ") and why in msg, msg
    assert "the drafter takes" in msg and "\n" not in msg


class Cfg:  # a HeadConfig's fields that the limits read
    def __init__(self, vocab_size=49152, draft_vocab_size=None):
        self.vocab_size, self.draft_vocab_size = vocab_size, draft_vocab_size


def test_messages_name_the_drafter_and_its_syntax():
    with pytest.raises(SpecheadsError) as e:
        parse_tree("3,100000,10", "eagle3", Cfg(draft_vocab_size=32000))
    msg = str(e.value)
    assert "draft vocabulary of 32000 tokens" in msg and "an EAGLE-3 head takes DEPTH,TOP_K,TOTAL" in msg
    assert "Medusa" not in msg.split("takes")[0]
    with pytest.raises(SpecheadsError, match="a Medusa head takes chain:K"):
        parse_tree("chain:x", "medusa", Cfg())
    with pytest.raises(SpecheadsError) as e:
        parse_tree("wide", "prompt-lookup")  # what `generate` uses when no --drafter is given
    assert "prompt-lookup takes a number of draft tokens per step" in str(e.value) and "None" not in str(e.value)
    with pytest.raises(SpecheadsError, match="--draft-tokens 0: .*draft-model takes"):
        parse_tree("0", "draft-model", flag="--draft-tokens")
    assert tree_limits(Cfg(draft_vocab_size=64)).max_rank == 64 and tree_limits(Cfg()).max_rank == 49152
    # defaults when --tree is not given
    assert parse_tree(None, "eagle", Cfg()) == TreeSpec.dynamic(5, 8, 48)
    assert parse_tree(None, "prompt-lookup").num_tokens == 8 and parse_tree(None, "plain").mode == "none"


@pytest.mark.parametrize("kw,flag", [({"temperature": math.nan}, "--temperature"), ({"temperature": math.inf}, "--temperature"),
                                     ({"temperature": -0.5}, "--temperature"), ({"top_p": math.nan}, "--top-p"),
                                     ({"top_p": 0.0}, "--top-p"), ({"top_p": 1.5}, "--top-p"),
                                     ({"top_k": -1}, "--top-k"), ({"top_k": 2.5}, "--top-k")])
def test_sampling_params_are_checked_for_library_callers_too(kw, flag):
    with pytest.raises(SpecheadsError, match=f"^{flag} "):
        SamplingParams(**kw)


def test_generate_rejects_nan_temperature(tiny):
    from specheads.infer.generate import generate

    with pytest.raises(SpecheadsError, match="--temperature nan: must be a finite number"):
        generate(tiny, None, [1, 2, 3], max_new_tokens=2, temperature=float("nan"))
    assert SamplingParams(temperature=0.7, top_p=0.9, top_k=5).top_k == 5


def test_specs_built_in_code_meet_the_same_bounds(tiny):
    from specheads.heads.base import HeadSpec, build_head
    from specheads.infer.drafters import build_drafter

    head = build_head(HeadSpec(kind="eagle"), tiny)  # vocab 256
    with pytest.raises(SpecheadsError, match="TOP_K 100000 is above the head's draft vocabulary of 256 tokens"):
        build_drafter(tiny, head, TreeSpec.dynamic(3, 100000, 10))
    with pytest.raises(SpecheadsError, match="a static tree spec does not fit this drafter; an EAGLE head takes"):
        build_drafter(tiny, head, TreeSpec.static([[0]]))
    with pytest.raises(SpecheadsError, match="the number of draft tokens 0 is outside 1..64"):
        build_drafter(tiny, "prompt-lookup", TreeSpec.tokens(0))
