"""Conversation reading, normalisation, chat-template masks (SmolLM2 tokenizer) and each bad input's message."""
from __future__ import annotations

import json

import pytest

from specheads.conversations.load import load_conversations
from specheads.conversations.sources import LoadStats, iter_json_array
from specheads.train.data import is_val, render_segments, tokenize_conversations
from specheads.utils import SpecheadsError

CONVS = [
    {"id": "a", "conversations": [{"from": "human", "value": "Hi there"},
                                  {"from": "gpt", "value": "Hello! How can I help?"}]},
    {"id": "b", "conversations": [{"from": "system", "value": "Be terse."}, {"from": "human", "value": "2+2?"},
                                  {"from": "gpt", "value": "4"}, {"from": "human", "value": "and 3+3?"},
                                  {"from": "chatgpt", "value": " 6\n\n  (six) "}]},
    {"id": "c", "conversations": [{"from": "gpt", "value": "I open."}, {"from": "human", "value": "Hm?"},
                                  {"from": "gpt", "value": "Code:\n```py\nprint('x')\n```"}]},
]


def _masked_text(tok, row):
    ids = [i for i, m in zip(row["input_ids"], row["loss_mask"]) if m]
    return tok.decode(ids, clean_up_tokenization_spaces=False)


def test_streaming_reader_keeps_complete_rows_of_cut_file(tmp_path):
    text = json.dumps(CONVS * 3, indent=2)
    cut = text[: text.rindex('"value": "Code') + 12]  # ends inside a string of the last row, like the packaged file
    p = tmp_path / "cut.json"
    p.write_text(cut)
    stats = LoadStats()
    rows = list(iter_json_array(p, stats, chunk_chars=64))  # tiny chunks: objects straddle many reads
    assert [r["id"] for r in rows] == ["a", "b", "c"] * 2 + ["a", "b"]
    assert stats.truncated_tail
    ds, st = load_conversations(str(p))
    assert len(ds) == 8 and st.truncated_tail and st.skipped == 0


def test_max_conversations_stops_early_and_jsonl_openai(tmp_path):
    p = tmp_path / "m.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(50)]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ds, st = load_conversations(str(p), max_conversations=7)
    assert len(ds) == 7 and st.stopped_early and st.rows_read == 7
    assert ds[3]["messages"][1] == {"role": "assistant", "content": "a3"}
    assert len(set(ds["conversation_id"])) == 7


def test_datasets_object_source():
    import datasets

    ds_in = datasets.Dataset.from_list(CONVS)
    ds, st = load_conversations(ds_in)
    assert ds["conversation_id"] == ["a", "b", "c"]
    # a conversation that opens with the assistant starts at the first user turn (FastChat convention)
    assert ds[2]["messages"][0] == {"role": "user", "content": "Hm?"}
    ds2, _ = load_conversations(datasets.DatasetDict({"train": ds_in}), max_conversations=2)
    assert ds2["conversation_id"] == ["a", "b"]


def test_malformed_rows_skipped_counted_and_shown(tmp_path, caplog):
    bad = [
        {"id": "x1", "conversations": []},
        {"id": "x2", "conversations": [{"from": "human"}]},
        {"id": "x3", "conversations": [{"from": "alien", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        {"id": "x4", "conversations": [{"from": "human", "value": 5}, {"from": "gpt", "value": "yo"}]},
        {"id": "x5", "text": "no turns"},
        ["not", "an", "object"],
    ]
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(CONVS[:1] + bad))
    with caplog.at_level("WARNING"):
        ds, st = load_conversations(str(p))
    assert len(ds) == 1 and st.skipped == len(bad)
    assert st.reasons == {"empty conversation": 1, "missing field": 2, "unknown role": 1, "non-string value": 1,
                          "not an object": 1}
    assert "row 1: empty conversation" in caplog.text and "alien" in caplog.text


@pytest.mark.parametrize("content,where", [("hello, this is plain text\n", "line 1, column 1"),
                                           ('[{"id": "a"}, {"id": oops}]', "line 1, column 22"),
                                           ('[\n  {"id": "a"}\n  {"id": "b"}\n]', "line 3, column 3")])
def test_not_json_file_one_error_with_position(tmp_path, content, where):
    p = tmp_path / "data.json"
    p.write_text(content)
    with pytest.raises(SpecheadsError) as e:
        load_conversations(str(p))
    assert str(p) in str(e.value) and where in str(e.value)


def test_not_jsonl_and_missing_file(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("garbage line\n{}\n")
    with pytest.raises(SpecheadsError, match=r"d\.jsonl: not valid JSON at line 1"):
        load_conversations(str(p))
    with pytest.raises(SpecheadsError, match="file not found"):
        load_conversations(str(tmp_path / "missing.json"))


def test_val_split_is_stable_and_near_fraction():
    ids = [f"id{i}" for i in range(4000)]
    share = sum(is_val(i, 0.1) for i in ids) / len(ids)
    assert 0.08 < share < 0.12
    assert [is_val(i, 0.1) for i in ids[:50]] == [is_val(i, 0.1) for i in ids[:50]]
    assert not any(is_val(i, 0.0) for i in ids)


def test_mask_round_trip_smollm2(smol_tokenizer):
    """Decoding the masked tokens gives back exactly the assistant texts, each followed by <|im_end|>."""
    import datasets

    tok = smol_tokenizer
    convs, _ = load_conversations(datasets.Dataset.from_list(CONVS))
    out, st = tokenize_conversations(convs, tok, max_length=4096)
    assert st["samples"] == 3 and st["dropped_empty_mask"] == 0
    for row, conv in zip(out, convs):
        expect = "".join(m["content"] + "<|im_end|>" for m in conv["messages"] if m["role"] == "assistant")
        assert _masked_text(tok, row) == expect
        # the unmasked + masked tokens are the template's full rendering
        full = tok.decode(row["input_ids"], clean_up_tokenization_spaces=False)
        assert full == tok.apply_chat_template(conv["messages"], tokenize=False)
        # the header "<|im_start|>assistant\n" and the user text are never trained on
        assert "user" not in _masked_text(tok, row)


def test_mask_round_trip_real_sharegpt(smol_tokenizer):
    """Same round trip on the first 30 packaged ShareGPT conversations (long, multi-turn, code, odd whitespace)."""
    tok = smol_tokenizer
    convs, st = load_conversations("sharegpt", max_conversations=30)
    out, tst = tokenize_conversations(convs, tok, max_length=10**6)
    assert tst["samples"] == len(convs) == 30
    by_id = {c["conversation_id"]: c for c in convs}
    for row in out:
        conv = by_id[row["conversation_id"]]
        expect = "".join(m["content"] + "<|im_end|>" for m in conv["messages"] if m["role"] == "assistant")
        assert _masked_text(tok, row) == expect


def test_truncation_and_empty_mask_dropped(smol_tokenizer):
    import datasets

    long_q = "word " * 300
    convs, _ = load_conversations(datasets.Dataset.from_list(
        [{"id": "long", "conversations": [{"from": "human", "value": long_q}, {"from": "gpt", "value": "ok"}]},
         CONVS[0]]))
    out, st = tokenize_conversations(convs, smol_tokenizer, max_length=64)
    assert st["dropped_empty_mask"] == 1 and out["conversation_id"] == ["a"]
    assert all(len(x) <= 64 for x in out["input_ids"])


class _NoTagTemplate:
    """A template without {% generation %} tags that trims assistant text and closes turns with </s>."""

    def __init__(self, tok):
        self.tok = tok
        self.tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}[A] {{ m['content'] | trim }}"
                                  "</s>{% else %}[{{ m['role'] }}] {{ m['content'] }}\n{% endif %}{% endfor %}"
                                  "{% if add_generation_prompt %}[A] {% endif %}")


def test_other_template_without_generation_tags(smol_tokenizer):
    import copy

    tok = copy.deepcopy(smol_tokenizer)
    _NoTagTemplate(tok)
    tok.add_special_tokens({"additional_special_tokens": ["</s>"]})
    msgs = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "  A1 "},
            {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]
    segs = render_segments(tok, msgs)
    assert [t for t, m in segs if m] == ["A1</s>", "A2</s>"]
    assert "".join(t for t, _ in segs) == tok.apply_chat_template(msgs, tokenize=False)


def test_reader_never_fails_on_any_cut_point(tmp_path):
    """A file cut at any character yields exactly the rows completed before the cut (never an error)."""
    rows = CONVS * 2 + [{"id": "n", "conversations": [{"from": "human", "value": "café \\u00e9 \"q\""}],
                         "x": [1.5e3, True, None, -12]}]
    text = json.dumps(rows, indent=1, ensure_ascii=False)
    ends = [len(json.dumps(rows[: i + 1], indent=1, ensure_ascii=False).rstrip("]").rstrip()) for i in range(len(rows))]
    p = tmp_path / "x.json"
    for cut in range(1, len(text), 5):
        p.write_text(text[:cut])
        got = list(iter_json_array(p, LoadStats(), chunk_chars=16))
        assert len(got) == sum(e <= cut for e in ends), cut


# ----------------------------------------------------------------------------- targets without a chat template

def _no_template(tok):
    import copy

    tok = copy.deepcopy(tok)
    tok.chat_template = None
    return tok


def test_tokenizer_without_template_is_one_clear_error(smol_tokenizer):
    """transformers raises ValueError from apply_chat_template on such a tokenizer (a traceback); ours names the
    target and both ways forward."""
    from specheads.train.data import chat_tokenizer

    base = _no_template(smol_tokenizer)
    with pytest.raises(ValueError, match="chat_template is not set"):
        base.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    with pytest.raises(SpecheadsError, match=r"target base-llm: its tokenizer has no chat template .*"
                                             r"data\.chat_template .*data\.mode=text"):
        chat_tokenizer(base, None, "base-llm")
    assert chat_tokenizer(smol_tokenizer, None, "t") is smol_tokenizer  # its own template: used as is


def test_chat_template_as_text_or_file_renders_masks(smol_tokenizer, tmp_path):
    """data.chat_template gives a template-less tokenizer SmolLM2's own template (text or file): the masks are the
    ones SmolLM2's tokenizer gives; the target's tokenizer object is not modified (a copy carries the template)."""
    from specheads.train.data import chat_tokenizer

    base = _no_template(smol_tokenizer)
    (tmp_path / "t.jinja").write_text(smol_tokenizer.chat_template)
    convs, _ = load_conversations([dict(c) for c in CONVS])
    ref, _ = tokenize_conversations(convs, smol_tokenizer, max_length=256)
    for given in (smol_tokenizer.chat_template, str(tmp_path / "t.jinja")):
        tok = chat_tokenizer(base, given, "base-llm")
        got, _ = tokenize_conversations(convs, tok, max_length=256)
        assert got["input_ids"] == ref["input_ids"] and got["loss_mask"] == ref["loss_mask"]
    assert base.chat_template is None
    with pytest.raises(SpecheadsError, match="data.chat_template 'nope.jinja': no such file"):
        chat_tokenizer(base, "nope.jinja", "base-llm")
    with pytest.raises(SpecheadsError, match="data.chat_template: cannot render a conversation"):
        chat_tokenizer(base, "{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}", "base-llm")


def test_load_texts_rows_and_txt_file(tmp_path):
    from specheads.conversations.load import load_texts

    p = tmp_path / "t.jsonl"
    rows = [{"text": "def add(a, b):\n    return a + b\n"}, {"id": "x", "text": "Once upon a time"}, {"text": ""},
            {"text": 3}, {"messages": []}, {"id": "x", "text": "again"}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ds, st = load_texts(str(p))
    assert ds["conversation_id"] == ["t-0", "x", "x~5"] and ds["text"][1] == "Once upon a time"
    assert st.skipped == 3 and st.reasons == {"empty text": 1, "non-string value": 1, "missing field": 1}
    doc = tmp_path / "book.txt"
    doc.write_text("Chapter 1\n\nIt was a dark night.\n")
    ds, _ = load_texts(str(doc))
    assert ds["conversation_id"] == ["book"] and ds["text"] == [doc.read_text()]
    with pytest.raises(SpecheadsError, match="file not found"):
        load_texts(str(tmp_path / "missing.txt"))


def test_tokenize_texts_windows_with_loss_on_every_token(smol_tokenizer):
    """A text longer than max_length becomes consecutive windows (nothing lost), each token trained; a 1-token
    tail holds no prediction and is dropped, counted."""
    import datasets

    from specheads.train.data import tokenize_texts

    text = "word " * 50
    full = smol_tokenizer(text, add_special_tokens=True)["input_ids"]
    L = 16 if len(full) % 16 != 1 else 17
    ds = datasets.Dataset.from_dict({"conversation_id": ["a", "b"], "text": [text, "hi there"]})
    out, st = tokenize_texts(ds, smol_tokenizer, max_length=L)
    windows = [ids for cid, ids in zip(out["conversation_id"], out["input_ids"]) if cid.split("#")[0] == "a"]
    assert sum(windows, []) == full and all(len(w) == L for w in windows[:-1])
    assert out["conversation_id"][:3] == ["a", "a#1", "a#2"] and st["split_texts"] == 1
    assert all(all(m == 1 for m in mask) for mask in out["loss_mask"])
    assert st["tokens"] == st["masked_tokens"] == sum(len(x) for x in out["input_ids"])
    n_ids = lambda k: len(smol_tokenizer("word " * k, add_special_tokens=True)["input_ids"])  # noqa: E731
    k = next(k for k in range(L, 4 * L) if n_ids(k) % L == 1)  # a text whose last window is 1 token
    tail, st2 = tokenize_texts(datasets.Dataset.from_dict({"conversation_id": ["s"], "text": ["word " * k]}),
                               smol_tokenizer, max_length=L)
    assert st2["dropped_empty_mask"] == 1 and all(len(x) == L for x in tail["input_ids"])
