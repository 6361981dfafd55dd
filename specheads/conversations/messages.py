"""Agentic and reasoning turns: tool calls, tool results, a tools schema, reasoning text and retrieved documents.

Read from a row (load.normalize_row calls `turn_extras` and `row_context`):
- OpenAI messages: role `tool` (also `function`, `ipython`) with `content`, `tool_call_id`, `name`; an assistant turn's
  `tool_calls` `[{id?, type: function, function: {name, arguments}}]` (arguments a JSON string or an object; its
  `content` may then be null) and `reasoning_content`; any turn may say `"loss": false` (kept in context, never
  trained: a retrieved passage given as a turn, a prefilled answer).
- ShareGPT: `from: function_call` (an assistant tool call; the value is the JSON `{name, arguments}` or a list of
  them: LLaMA-Factory's convention), `from: observation | tool | function` (a tool result).
- The row's `tools` (a list of JSON-schema function specs, or that list as a JSON string) and `documents` (retrieved
  passages: a list of `{title?, text}` objects or of strings), passed to the chat template as `tools=` and
  `documents=` (transformers' apply_chat_template convention).
Each tool call is normalised to what Hugging Face chat templates expect: `{type: function, function: {name,
arguments: <object>}}` (a JSON-string `arguments` is parsed; most templates apply `| tojson` to it).

Stored form (the conversations Dataset): a message holds `role`, `content` and only those of MESSAGE_EXTRAS that some
message of the dataset has (`tool_calls` as the JSON text of the normalised list: Arrow needs one schema, arguments
have any); a conversation holds `tools` / `documents` (JSON text) only when some row has them. `template_message`
turns either form (stored, or a row's) into the dict apply_chat_template takes.
"""
from __future__ import annotations

import json
from typing import Any

from specheads.conversations.sources import Malformed
from specheads.utils import SpecheadsError

TOOL_ROLES = ("tool", "function", "observation", "ipython")  # a tool's result, whichever name the source uses
MESSAGE_EXTRAS = ("token_ids", "tool_calls", "reasoning_content", "tool_call_id", "name", "loss")
CONTEXT_FIELDS = ("tools", "documents")
NOT_TEMPLATED = ("token_ids", "loss")  # ours, not the template's


ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
            "system": "system", "function_call": "assistant", **{r: "tool" for r in TOOL_ROLES}}
# apply_chat_template's own arguments: a data.chat_template_kwargs key may not replace them
RESERVED_TEMPLATE_ARGS = ("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                          "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                          "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")


def check_template_kwargs(kwargs: Any) -> None:
    """data.chat_template_kwargs: a mapping of template variables (one error naming the key otherwise)."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise SpecheadsError(f"data.chat_template_kwargs: expected a mapping such as {{enable_thinking: false}}, got "
                             f"{kwargs!r}")
    bad = [k for k in kwargs if not isinstance(k, str) or k in RESERVED_TEMPLATE_ARGS]
    if bad:
        raise SpecheadsError(f"data.chat_template_kwargs: {bad[0]!r} is not a template variable specheads leaves to "
                             f"you (reserved: {', '.join(RESERVED_TEMPLATE_ARGS)})")


def parse_turn(t: dict, i: int, rk: str, ck: str) -> dict:
    """One turn as a message: role, content and its extras (tool calls, reasoning, tool ids, loss flag)."""
    if rk not in t or (ck not in t and not t.get("tool_calls")):
        raise Malformed(f"missing field: turn {i} lacks {rk!r} or {ck!r}")
    role, content = t[rk], t.get(ck)
    if not isinstance(role, str) or role.lower() not in ROLE_MAP:
        raise Malformed(f"unknown role: turn {i} has {rk}={role!r}")
    calls = None
    if role.lower() == "function_call":  # ShareGPT's assistant tool call: the value is the call (JSON)
        calls, content = parse_tool_calls(content, f"turn {i} value"), ""
    if ROLE_MAP[role.lower()] == "tool" and isinstance(content, (dict, list)):
        content = json.dumps(content, ensure_ascii=False)  # a tool's structured result, as its text
    if content is None and t.get("tool_calls") is not None:
        content = ""  # OpenAI: an assistant turn that only calls tools has content null
    if not isinstance(content, str):
        raise Malformed(f"non-string value: turn {i} {ck} is a {type(content).__name__}")
    m = {"role": ROLE_MAP[role.lower()], "content": content}
    m.update(turn_extras(t, i, m["role"]))
    if calls is not None:
        m["tool_calls"] = calls
    return m


def _json_text(value: Any, what: str) -> Any:
    """`value` parsed if it is JSON text (else as given); raises Malformed "{what} not JSON (why)"."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise Malformed(f"{what} not JSON ({e.msg})") from None


def parse_tool_calls(value: Any, where: str) -> list[dict]:
    """A turn's tool calls -> [{type: function, function: {name, arguments: dict}, id?}]; raises Malformed."""
    value = _json_text(value, f"bad tool_calls: {where} is")
    value = [value] if isinstance(value, dict) else value
    if not isinstance(value, list) or not value:
        raise Malformed(f"bad tool_calls: {where} is not a non-empty list of calls")
    out = []
    for k, call in enumerate(value):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise Malformed(f"bad tool_calls: {where} call {k} has no function name")
        args = fn.get("arguments", fn.get("parameters"))
        if args is None or args == "":
            args = {}
        args = _json_text(args, f"bad tool_calls: {where} call {k} arguments are")
        if not isinstance(args, dict):
            raise Malformed(f"bad tool_calls: {where} call {k} arguments are a {type(args).__name__}, not an object")
        norm = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            norm["id"] = call["id"]
        out.append(norm)
    return out


def turn_extras(turn: dict, i: int, role: str) -> dict:
    """The extra fields of turn i (already mapped to `role`): tool_calls, reasoning_content, tool_call_id, name,
    loss; raises Malformed on a wrong type."""
    out: dict[str, Any] = {}
    if turn.get("tool_calls") is not None:
        if role != "assistant":
            raise Malformed(f"bad tool_calls: turn {i} is a {role} turn")
        out["tool_calls"] = parse_tool_calls(turn["tool_calls"], f"turn {i}")
    for key, roles in (("reasoning_content", ("assistant",)), ("tool_call_id", ("tool",)), ("name", ("tool",))):
        v = turn.get(key)
        if v is None or role not in roles:
            continue
        if not isinstance(v, str):
            raise Malformed(f"non-string value: turn {i} {key} is a {type(v).__name__}")
        out[key] = v
    if "loss" in turn:
        if not isinstance(turn["loss"], bool):
            raise Malformed(f"bad loss flag: turn {i} loss is {turn['loss']!r}, not true/false")
        if not turn["loss"]:
            out["loss"] = False
    return out


def row_context(row: dict) -> dict:
    """The row's `tools` and `documents` (lists, given as such or as JSON text); {} when it has neither."""
    out = {}
    for key in CONTEXT_FIELDS:
        v = row.get(key)
        if v is None or v == "" or v == []:
            continue
        v = _json_text(v, f"bad {key}:")
        if not isinstance(v, list):
            raise Malformed(f"bad {key}: a {type(v).__name__}, not a list")
        if key == "documents":
            v = [{"text": d} if isinstance(d, str) else d for d in v]
        if not all(isinstance(d, dict) for d in v):
            raise Malformed(f"bad {key}: every entry must be an object")
        out[key] = v
    return out


def has_answer(m: dict) -> bool:
    """An assistant turn with something to train on: text, a tool call or reasoning."""
    return bool(m["content"].strip() or m.get("tool_calls") or (m.get("reasoning_content") or "").strip())


def template_message(m: dict) -> dict:
    """A message (stored or row form) as apply_chat_template takes it: no None fields, tool_calls a list."""
    out = {k: v for k, v in m.items() if v is not None and k not in NOT_TEMPLATED}
    if isinstance(out.get("tool_calls"), str):
        out["tool_calls"] = json.loads(out["tool_calls"])
    return out


def row_message(m: dict) -> dict:
    """A stored message as a row's (what regenerate writes, normalize_row reads back)."""
    out = {k: v for k, v in m.items() if v is not None}
    if isinstance(out.get("tool_calls"), str):
        out["tool_calls"] = json.loads(out["tool_calls"])
    return out


def context_kwargs(row: dict) -> dict:
    """tools= / documents= for apply_chat_template from a conversation (stored JSON text or a row's lists)."""
    out = {}
    for key in CONTEXT_FIELDS:
        v = row.get(key)
        if v is not None:
            out[key] = json.loads(v) if isinstance(v, str) else v
    return out


def stored(messages: list[dict], context: dict, msg_fields: set[str], ctx_fields: set[str]) -> tuple[list, dict]:
    """One conversation in the stored form, every message with exactly `msg_fields` (None where absent)."""
    msgs = []
    for m in messages:
        s = {"role": m["role"], "content": m["content"]}
        for k in MESSAGE_EXTRAS:
            if k in msg_fields:
                v = m.get(k)
                s[k] = json.dumps(v, ensure_ascii=False) if k == "tool_calls" and v is not None else v
        msgs.append(s)
    ctx = {k: (json.dumps(context[k], ensure_ascii=False) if k in context else None) for k in ctx_fields}
    return msgs, ctx


def conversation_features(msg_fields=(), ctx_fields=()):
    """conversation_id, messages[{role, content} + the MESSAGE_EXTRAS in `msg_fields`] + the CONTEXT_FIELDS in
    `ctx_fields` (JSON text)."""
    import datasets

    types = {"token_ids": datasets.List(datasets.Value("int32")), "loss": datasets.Value("bool")}
    msg = {"role": datasets.Value("string"), "content": datasets.Value("string")}
    msg.update({k: types.get(k, datasets.Value("string")) for k in MESSAGE_EXTRAS if k in set(msg_fields)})
    feats = {"conversation_id": datasets.Value("string"), "messages": datasets.List(msg)}
    feats.update({k: datasets.Value("string") for k in CONTEXT_FIELDS if k in set(ctx_fields)})
    return datasets.Features(feats)


def fields_of(convs) -> tuple[set[str], set[str]]:
    """(message extras, context columns) a conversations Dataset carries."""
    msg = set(convs.features["messages"].feature) - {"role", "content"}
    return msg, set(convs.column_names) & set(CONTEXT_FIELDS)


def align(parts: list) -> list:
    """Conversation Datasets given the same features (the union of theirs; absent fields None), to concatenate."""
    msg, ctx = set(), set()
    for p in parts:
        m, c = fields_of(p)
        msg, ctx = msg | m, ctx | c
    feats = conversation_features(msg, ctx)
    out = []
    for p in parts:
        if p.features == feats:
            out.append(p)
            continue
        def fill(row, msg=msg, ctx=ctx):
            ms, cx = stored([row_message(m) for m in row["messages"]], context_kwargs(row), msg, ctx)
            return {"messages": ms, **cx}
        out.append(p.map(fill, features=feats, remove_columns=[c for c in p.column_names
                                                                 if c not in ("conversation_id",)],
                         desc="align columns"))
    return out

