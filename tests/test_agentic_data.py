"""Agentic and reasoning data (issue 52 point 4): tool calls, tool results, a tools schema, reasoning, retrieved
documents through a chat template, with the loss mask checked by hand; data.chat_template_kwargs; data.sources.

The template is written here (a small Qwen/Hermes-style one: <tool_call> tags, tool results wrapped in a user turn
as Qwen does, a <think> block, documents= and enable_thinking), on SmolLM2's tokenizer from the bundled assets."""
from __future__ import annotations

import json

import pytest

from specheads.conversations.load import load_conversations
from specheads.train.data import chat_tokenizer, is_val, tokenize_conversations
from specheads.utils import SpecheadsError

TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}"
    "{{- messages[0].content + '\\n\\n' }}{%- endif %}{{- '# Tools\\n<tools>' }}{%- for t in tools %}"
    "{{- '\\n' + (t | tojson) }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- if documents %}{{- '<|im_start|>system\\n' }}{%- for d in documents %}"
    "{{- '<document>' + d.text + '</document>\\n' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content or (enable_thinking is defined and enable_thinking is false) %}"
    "{{- '<think>\\n' + (m.reasoning_content or '') + '\\n</think>\\n\\n' }}{%- endif %}{{- m.content }}"
    "{%- for c in m.tool_calls or [] %}{{- '<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": '"
    " + (c.function.arguments | tojson) + '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_ROME = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


def openai_row():
    """Two parallel tool calls (content null; one arguments object, one JSON string), two results, a reasoned
    answer."""
    return {"id": "w", "tools": [WEATHER], "messages": [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": '{"temp": 18}'},
        {"role": "tool", "tool_call_id": "c2", "content": '{"temp": 24}'},
        {"role": "assistant", "reasoning_content": "Rome is warmer.", "content": "Paris is 18 C, Rome 24 C."}]}


@pytest.fixture(scope="module")
def smol_tok():
    """SmolLM2's tokenizer alone (the bundled GGUF's converted folder), without loading the model."""
    from transformers import AutoTokenizer

    from specheads.target import resolve_target_path

    return AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m"))


@pytest.fixture(scope="module")
def tool_tok(smol_tok):
    return chat_tokenizer(smol_tok, TEMPLATE, "smollm2")


def spans(tok, row) -> list[str]:
    """Each run of trained (loss 1) tokens, decoded."""
    out, cur = [], []
    for i, m in zip(list(row["input_ids"]) + [0], list(row["loss_mask"]) + [0]):
        if m:
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    return out


def tokenized(tok, rows, max_length=1024):
    convs, stats = load_conversations(rows)
    tokens, tstats = tokenize_conversations(convs, tok, max_length)
    return convs, stats, tokens, tstats


def test_tool_call_conversation_mask_by_hand(tool_tok):
    """Loss on the tool calls as the template writes them and on the reasoned answer, each with <|im_end|>; none
    on the system prompt, the tools schema, the user turn or the tool results."""
    convs, _, tokens, tstats = tokenized(tool_tok, [openai_row()])
    assert tstats["samples"] == 1 and tstats["dropped_template"] == 0
    assert spans(tool_tok, tokens[0]) == [
        CALL_PARIS + CALL_ROME + "<|im_end|>",
        "<think>\nRome is warmer.\n</think>\n\nParis is 18 C, Rome 24 C.<|im_end|>"]
    text = tool_tok.decode(tokens[0]["input_ids"])
    assert text == (  # the whole rendering, by hand: the tools schema, both calls (the JSON-string arguments parsed
        # once, not encoded twice by the template's tojson), the results wrapped in one user turn
        '<|im_start|>system\nYou are a weather bot.\n\n# Tools\n<tools>\n' + json.dumps(WEATHER)
        + '\n</tools><|im_end|>\n<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n<|im_start|>assistant\n'
        + CALL_PARIS + CALL_ROME + '<|im_end|>\n<|im_start|>user\n<tool_response>\n{"temp": 18}\n</tool_response>'
        '\n<tool_response>\n{"temp": 24}\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\nRome is '
        'warmer.\n</think>\n\nParis is 18 C, Rome 24 C.<|im_end|>\n')
    untrained = tool_tok.decode([i for i, m in zip(tokens[0]["input_ids"], tokens[0]["loss_mask"]) if not m])
    for context in ('"name": "get_weather", "parameters"', "<tool_response>\n{\"temp\": 18}\n</tool_response>",
                    "Weather in Paris and Rome?", "You are a weather bot."):
        assert context in untrained
    assert json.loads(convs[0]["messages"][2]["tool_calls"])[1]["function"]["arguments"] == {"city": "Rome"}


def test_sharegpt_function_call_and_observation(tool_tok):
    """LLaMA-Factory's ShareGPT: function_call / observation turns and tools as a JSON string."""
    row = {"id": "s", "tools": json.dumps([WEATHER]), "conversations": [
        {"from": "human", "value": "Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": '{"temp": 18}'},
        {"from": "gpt", "value": "18 C."}]}
    _, _, tokens, _ = tokenized(tool_tok, [row])
    assert spans(tool_tok, tokens[0]) == [CALL_PARIS + "<|im_end|>", "18 C.<|im_end|>"]
    assert "<tools>" in tool_tok.decode(tokens[0]["input_ids"])


def test_malformed_tool_rows_counted_and_skipped(tool_tok):
    good = openai_row()
    bad_calls = ["not json", [], [{"function": {"arguments": {}}}], [{"function": {"name": "f", "arguments": "[1]"}}],
                 [{"function": {"name": "f", "arguments": "{oops"}}]]
    rows = [good]
    for k, calls in enumerate(bad_calls):
        rows.append({"id": f"b{k}", "messages": [{"role": "user", "content": "q"},
                                                 {"role": "assistant", "content": "", "tool_calls": calls}]})
    rows.append({"id": "u", "messages": [{"role": "user", "content": "q", "tool_calls": [{"name": "f"}]},
                                         {"role": "assistant", "content": "a"}]})
    rows.append({"id": "t", "tools": {"name": "f"}, "messages": good["messages"]})  # tools not a list
    convs, stats = load_conversations(rows)
    assert convs["conversation_id"] == ["w"]
    assert stats.skipped == 7 and stats.reasons == {"bad tool_calls": 6, "bad tools": 1}


def test_documents_and_loss_false_are_context(tool_tok, smol_tok):
    """Retrieved passages (documents=) and a prefilled assistant turn flagged loss false: in the tokens, untrained.
    A template that does not render documents drops the conversation, counted, with the reason."""
    row = {"id": "r", "documents": ["Paris is in France.", {"text": "Rome is in Italy."}], "messages": [
        {"role": "user", "content": "Where is Rome?"},
        {"role": "assistant", "content": "Let me look.", "loss": False},
        {"role": "user", "content": "Go on."},
        {"role": "assistant", "content": "Italy."}]}
    _, _, tokens, _ = tokenized(tool_tok, [row])
    assert spans(tool_tok, tokens[0]) == ["Italy.<|im_end|>"]
    text = tool_tok.decode(tokens[0]["input_ids"])
    assert "<document>Rome is in Italy.</document>" in text and "Let me look.<|im_end|>" in text
    _, _, tokens, tstats = tokenized(smol_tok, [row])  # SmolLM2's own template renders no documents
    assert len(tokens) == 0 and tstats["dropped_template"] == 1


def test_chat_template_kwargs_reach_tokenisation_and_regeneration_prompts(smol_tok):
    from specheads.train.regenerate import history_prompt_ids

    tok = chat_tokenizer(smol_tok, TEMPLATE, "smollm2", {"enable_thinking": False})
    row = {"id": "k", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    _, _, tokens, _ = tokenized(tok, [row])
    assert spans(tok, tokens[0]) == ["Hello.<|im_end|>"]
    assert tok.decode(tokens[0]["input_ids"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nHello."
                                                       "<|im_end|>\n")
    prompt = history_prompt_ids(tok, row["messages"][:1], [])
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = chat_tokenizer(smol_tok, TEMPLATE, "smollm2")  # without the kwargs: the template's default
    assert tok.decode(history_prompt_ids(plain, row["messages"][:1], [])).endswith("<|im_start|>assistant\n")


def test_regeneration_keeps_tool_turns_and_rewrites_text_answers(tool_tok, tmp_path):
    """The tool call and the tool results stay as the source wrote them (context for the answer after them); the
    text answer is the target's own (token ids kept); the tools schema survives into the regenerated file."""
    from specheads.target import tiny_target
    from specheads.train.regenerate import read_regenerated, regenerate

    target = tiny_target(vocab_size=len(tool_tok), tokenizer=tool_tok)
    convs, _ = load_conversations([openai_row()])
    out = tmp_path / "regen.jsonl"
    regenerate(target, convs, out, max_length=512, max_new_tokens=4, batch_size=1, progress=False)
    written = json.loads(out.read_text())
    msgs = written["messages"]
    assert written["tools"] == [WEATHER]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert msgs[3] == {"role": "tool", "content": '{"temp": 18}', "tool_call_id": "c1", "name": "get_weather"}
    assert "token_ids" not in msgs[2] and len(msgs[5]["token_ids"]) >= 1
    back, _ = read_regenerated(out, {"w"})
    _, tstats = tokenize_conversations(back, tool_tok, 512)
    assert tstats["samples"] == 1


def _jsonl(path, n, prefix):
    path.write_text("".join(json.dumps({"id": f"{prefix}{i}", "messages": [
        {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}) + "\n" for i in range(n)))
    return str(path)


def test_several_sources_mixed_by_weight_seeded(tmp_path):
    from specheads.train.mix import load_mixed
    from specheads.conversations.sources import SourceSpec

    a, b = _jsonl(tmp_path / "a.jsonl", 10, "x"), _jsonl(tmp_path / "b.jsonl", 10, "x")  # the same ids in both
    specs = [SourceSpec(source=a, limit=6), SourceSpec(source=b, weight=0.5), SourceSpec(source=a, weight=2.0,
                                                                                        name="again", limit=2)]
    mixed, stats, rows = load_mixed(specs, load_conversations, seed=3)
    ids = mixed["conversation_id"]
    assert len(ids) == 6 + 5 + 4 == len(set(ids))
    assert sorted(i for i in ids if i.startswith("a:")) == sorted(f"a:x{k}" for k in range(6))
    assert sum(i.startswith("b:") for i in ids) == 5
    assert sorted(i for i in ids if i.startswith("again:")) == ["again:x0", "again:x0~rep1", "again:x1",
                                                               "again:x1~rep1"]
    assert [r["in_mix"] for r in rows] == [6, 5, 4] and [r["name"] for r in rows] == ["a", "b", "again"]
    assert is_val("again:x0~rep1", 0.5) == is_val("again:x0", 0.5)  # a repeat is held out with its original
    again, _, _ = load_mixed(specs, load_conversations, seed=3)
    assert again["conversation_id"] == ids  # deterministic
    other, _, _ = load_mixed(specs, load_conversations, seed=4)
    assert other["conversation_id"] != ids and len(other) == len(ids)  # another order, another half of b
    cut, st, _ = load_mixed(specs, load_conversations, seed=3, max_total=4)
    assert cut["conversation_id"] == ids[:4] and st.stopped_early


def test_recipe_refusals_name_the_keys(tmp_path):
    from specheads.config import load_config
    from specheads.train.recipe import Recipe

    src = f"[{{source: {_jsonl(tmp_path / 'a.jsonl', 2, 'x')}}}]"
    with pytest.raises(SpecheadsError, match="data.source and data.sources: both given"):
        load_config(Recipe, None, ["data.source=sharegpt", f"data.sources={src}"])
    assert load_config(Recipe, None, [f"data.sources={src}"]).data.source is None
    assert load_config(Recipe, None, []).data.source == "sharegpt"
    with pytest.raises(SpecheadsError, match="data.chat_template_kwargs"):
        load_config(Recipe, None, ["data.chat_template_kwargs=thinking"])
    with pytest.raises(SpecheadsError, match="data.chat_template_kwargs: 'tools' is not a template variable"):
        load_config(Recipe, None, ["data.chat_template_kwargs={tools: 1}"])
    with pytest.raises(SpecheadsError, match=r"data.sources\[.*\]\.weight: must be > 0"):
        load_config(Recipe, None, [f"data.sources=[{{source: x.jsonl, weight: 0}}]"])


def test_sources_round_trip_through_the_written_recipe(tmp_path):
    """prepare_config.yaml holds data.sources as plain mappings and reads back as the same recipe."""
    from specheads.config import load_config, save_config
    from specheads.train.recipe import Recipe

    src = f"[{{source: {_jsonl(tmp_path / 'a.jsonl', 2, 'x')}, weight: 0.5, name: mine}}]"
    r = load_config(Recipe, None, [f"data.sources={src}", "data.chat_template_kwargs={enable_thinking: false}"])
    save_config(r, tmp_path / "r.yaml")
    back = load_config(Recipe, tmp_path / "r.yaml")
    assert back.data == r.data and back.data.sources[0].name == "mine"
