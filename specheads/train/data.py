"""Conversations -> chat-templated token ids with assistant-only loss masks.

Sources (`DataConfig.source`): the alias `sharegpt` (the packaged ShareGPT V3 file), a ShareGPT JSON array or JSONL
file (`conversations: [{from, value}]`), an OpenAI-style JSONL file (`messages: [{role, content}]`), a hub dataset id,
or a `datasets.Dataset` passed to `load_conversations` directly. Reading them into normalised rows needs no target:
it is specheads/conversations/ (load.py, sources.py, messages.py), which prompts.py reads ShareGPT prompts with too.
`data.sources` mixes several of them by weight (train/mix.py).

Normalised conversations are a `datasets.Dataset` with columns `conversation_id: str` and
`messages: list[{role, content, ...}]` (roles `system | user | assistant | tool`), plus the tool calls, reasoning,
tool ids and loss flags of agentic data and the `tools` / `documents` columns where the source has them
(conversations/messages.py). `data.chat_template_kwargs` reach every rendering (`chat_tokenizer`, `render_text`).

Plain-text mode (`data.mode: text`, for targets without a chat template, e.g. base models): `load_texts`
(conversations/load.py) reads rows `{"text": ...}` (JSONL / JSON / hub / Dataset) or a .txt file (one text),
`tokenize_texts` cuts each text into windows of max_length tokens with loss on every token; a target without a
template and no `data.chat_template` is one clear error naming both ways forward (`chat_tokenizer`).

Loss mask: 1 on the assistant's content tokens **and on the template's end-of-turn token** that closes each
assistant turn (`<|im_end|>` for ChatML templates such as SmolLM2's): the head must learn to predict the end of a
turn, since the target emits it. Everything else (system prompt, user turns, the `<|im_start|>assistant\\n` header,
the newline after `<|im_end|>`) is 0.

How the mask is found without `{% generation %}` tags: the template is rendered prefix by prefix. For assistant
message i, `render(messages[:i], add_generation_prompt=True)` is a prefix of `render(messages[:i+1])`; the difference
holds the content (located with `str.find`) followed by the turn's suffix, whose leading special token (if any) is the
end-of-turn token. Each text segment is tokenised on its own and the ids are concatenated, which is how the target
sees an answer it generated itself (the prompt is tokenised, the answer arrives as tokens); decoding the masked ids
therefore gives back exactly the assistant texts plus the end-of-turn token. A regenerated answer that carries
`token_ids` (data/regenerated.jsonl) is trained on exactly those ids, not on its text re-encoded. A turn with tool
calls or reasoning is trained on everything the template writes after the generation prompt up to and including
its end-of-turn token (the `<think>` block, the text, each `<tool_call>`); tool results, retrieved documents and
turns flagged `"loss": false` are context (0).
"""
from __future__ import annotations

import collections
import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from specheads.conversations.messages import CONTEXT_FIELDS, check_template_kwargs, context_kwargs, template_message
from specheads.conversations.sources import SHOW_REASONS, Malformed, SourceSpec
from specheads.train.regen_endpoint import check_endpoint_settings
from specheads.utils import CHAT_KWARGS_ATTR, DTYPE_NAMES, SpecheadsError, check_values, template_kwargs

log = logging.getLogger(__name__)


@dataclass
class DataConfig:
    source: str | None = None  # alias, ShareGPT JSON/JSONL, OpenAI messages JSONL, or a hub dataset id (None and
    # no data.sources: the alias sharegpt, the bundled 17,671-conversation ShareGPT V3 part)
    sources: list[SourceSpec] | None = None  # several sources mixed by weight, seeded (train/mix.py): instead of
    # data.source, never beside it
    chat_template_kwargs: dict[str, Any] | None = None  # passed to every apply_chat_template call that renders the
    # data (tokenisation, regeneration prompts), e.g. {enable_thinking: false} for Qwen3's non-thinking mode
    max_conversations: int | None = None  # None = all; reading stops once this many valid conversations are kept
    max_length: int = 2048  # tokens per sample (truncated)
    val_fraction: float = 0.02  # held-out share for evaluation (chosen by a hash of the conversation id)
    regenerate: bool = False  # replace assistant turns with the target's own answers (self-distillation)
    regen_max_new_tokens: int = 512  # tokens per regenerated answer (cap; also bounded by max_length)
    regen_batch_size: int = 32  # rows of the engine's batched loop (refilled as rows finish; HF forward); 1 = the
    # one-row loop (the target's own forward path: owned, compiled on a bf16 CPU target); also answers per fsync
    regen_temperature: float = 0.0  # 0 = greedy (the default: the head learns the target's argmax)
    regen_top_p: float = 1.0  # nucleus cut when sampling (1.0 = off)
    regen_max_turns: int | None = None  # regenerate (and keep) only the first N exchanges; None = all (a next turn
    # is decoded in the next wave of its group of conversations, train/regenerate.answer_in_groups)
    regen_conversations: int | None = None  # regenerate only the first N kept conversations; the rest keep the
    # source's replies (None = all). Mixes cheap extra data in: extraction ~1,100 tok/s vs regeneration ~250 on 2 cores
    regen_dtype: str | None = None  # target dtype for regeneration (None = target.dtype). Which is faster depends
    # on the CPU and library versions (measured both ways round on one 2-core AVX-512 CPU): time both on yours
    mode: Literal["chat", "text"] = "chat"  # chat: conversations through the chat template, loss on assistant
    # turns; text: plain texts (JSONL rows {"text": ...} or a .txt file), cut into max_length windows, loss on
    # every token (base models, code completion, plain continuation)
    chat_template: str | None = None  # for targets without one: a Jinja template file or the template text
    # (None = the tokenizer's own); it renders the conversations and the regeneration prompts
    regen_prefix_tokens: int = 32  # text mode + regenerate: tokens of each window kept as the prompt, the target
    # writes the rest (up to max_length). 32 tokens = a sentence or two of context: most of a window is the target's
    regen_endpoint: str | None = None  # an OpenAI-compatible server answers instead of our engine (vLLM, SGLang,
    # llama-server), e.g. http://127.0.0.1:8080/v1 (train/regen_endpoint.py); None = our own decoding
    regen_model: str | None = None  # the requests' `model` (None: left out, the server's own model)
    regen_api: Literal["completions", "chat"] = "completions"  # completions: our template's token ids as the prompt
    # (the template applied exactly as we apply it); chat: the messages, the server applies its own template
    regen_concurrency: int = 8  # requests in flight at once (match the server's parallel slots or more)
    regen_timeout_s: float = 600.0  # one request's limit (s): 512 tokens at ~1 tok/s per slot on a loaded CPU
    regen_retries: int = 5  # tries after the first on a connection error, timeout, 408 / 429 / 5xx (backoff 0.5 s,
    # doubled per try: ~15 s in all), then one error naming the endpoint

    def __post_init__(self) -> None:
        check_values("data", self, {"max_conversations": ">=1|None", "max_length": ">=2", "val_fraction": "[0,1)",
                                    "regen_max_new_tokens": ">=1", "regen_batch_size": ">=1",
                                    "regen_temperature": ">=0", "regen_top_p": "(0,1]", "regen_max_turns": ">=1|None",
                                    "regen_conversations": ">=1|None", "regen_concurrency": ">=1",
                                    "regen_timeout_s": ">0", "regen_retries": ">=0"})
        if self.sources is not None and self.source is not None:
            raise SpecheadsError(f"data.source and data.sources: both given ({self.source!r} and {len(self.sources)} "
                                 f"sources); keep one (data.sources lists several, data.source names one)")
        if self.sources is not None and not self.sources:
            raise SpecheadsError("data.sources: an empty list (name at least one source, or give data.source)")
        if self.sources is None and self.source is None:
            self.source = "sharegpt"
        if self.source is not None and (not isinstance(self.source, str) or not self.source.strip()):
            raise SpecheadsError(f"data.source: expected a file, hub id or alias, got {self.source!r}")
        check_template_kwargs(self.chat_template_kwargs)
        if self.regen_conversations is not None and not self.regenerate:
            raise SpecheadsError("data.regen_conversations: set, but data.regenerate is false (nothing to regenerate)")
        if self.regen_dtype is not None and self.regen_dtype not in REGEN_DTYPES:
            raise SpecheadsError(f"data.regen_dtype: {self.regen_dtype!r} is not one of {list(REGEN_DTYPES)} or null")
        check_mode_settings(self)
        check_endpoint_settings(self)


REGEN_DTYPES = tuple(DTYPE_NAMES)  # the target dtypes a recipe may name


REPEAT = re.compile(r"~rep\d+")  # a conversation repeated by a data.sources weight > 1 (train/mix.py)


def is_val(conversation_id: str, val_fraction: float) -> bool:
    """Held-out membership from a hash of the id: stable across runs, orders and regeneration. A repeat of a
    conversation (`~repK`, a data.sources weight above 1) lands on its original's side."""
    if val_fraction <= 0:
        return False
    key = REPEAT.sub("", conversation_id)
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0 ** 64
    return h < val_fraction


# -------------------------------------------------------------------------------------------------------- templates

def render_text(tokenizer, messages: list[dict], add_generation_prompt: bool = False,
                context: dict | None = None) -> str:
    """The template's text of `messages` (stored or row form) with the conversation's tools= / documents= and
    data.chat_template_kwargs; a template that raises on them is Malformed (the conversation is dropped, counted)."""
    if not messages:
        return ""
    import jinja2

    kwargs = dict(template_kwargs(tokenizer), **(context or {}))
    try:
        return tokenizer.apply_chat_template([template_message(m) for m in messages], tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **kwargs)
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
        raise Malformed(f"template error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def _template_source(tokenizer) -> str:
    t = getattr(tokenizer, "chat_template", None) or ""
    return " ".join(t.values()) if isinstance(t, dict) else str(t)


def special_tokens(tokenizer) -> list[str]:
    toks = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for t in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(t, "special", False):
            toks.add(str(t.content if hasattr(t, "content") else t))
    return sorted((t for t in toks if t), key=len, reverse=True)


def render_segments(tokenizer, messages: list[dict], specials: list[str] | None = None,
                    add_generation_prompt: bool = False, context: dict | None = None
                    ) -> list[tuple[str | list[int], bool]]:
    """The rendered conversation as (text, trained) segments; trained = assistant content + end-of-turn token
    (an assistant turn with `loss: false` is context, untrained). An assistant message with `token_ids` (a
    regenerated answer) gives its content as those ids, not its text, then its end-of-turn token as text: the
    target's own tokens, which decode -> encode would change. A turn with tool calls or reasoning trains on all the
    template renders after the generation prompt up to its end-of-turn token (`_agentic_span`): the reasoning, the
    text and each tool call as the template writes them. `context`: the conversation's tools= / documents=.
    Raises Malformed when the template does not render prefix-consistently for this conversation."""
    specials = special_tokens(tokenizer) if specials is None else specials
    context = context or {}
    if context.get("documents") and "documents" not in _template_source(tokenizer):
        raise Malformed("documents: the chat template does not render documents= (the passages would be left out); "
                        "give them as a turn with \"loss\": false, or use a template that renders them")
    segs: list[tuple[str | list[int], bool]] = []
    done, prev = "", ""  # text covered so far; the rendering of the messages before this one
    for i, m in enumerate(messages):
        full = render_text(tokenizer, messages[: i + 1], context=context)
        if m["role"] != "assistant":
            prev = full
            continue
        gen = render_text(tokenizer, messages[:i], add_generation_prompt=True, context=context)
        if not gen.startswith(done) or not full.startswith(gen):
            raise Malformed("template not prefix-consistent: cannot locate the assistant turn")
        region, trained = full[len(gen):], m.get("loss") is not False
        if m.get("tool_calls") or m.get("reasoning_content"):
            end, eot = _agentic_span(tokenizer, messages, i, gen, prev, region, specials, context)
            segs += [(gen[len(done):], False), (region[:end] + eot, trained)]
            done, prev = gen + region[: end + len(eot)], full
            continue
        content = m["content"]
        idx = region.find(content) if content else 0
        if idx < 0 and content.strip():
            content = content.strip()  # templates that trim the message
            idx = region.find(content)
        if idx < 0:
            raise Malformed("template not prefix-consistent: assistant text not found in the rendering")
        suffix = region[idx + len(content):]
        eot = next((s for s in specials if suffix.startswith(s)), "")
        segs.append((gen[len(done):] + region[:idx], False))
        if m.get("token_ids") is not None:
            segs += [([int(t) for t in m["token_ids"]], trained), (eot, trained)]
        else:
            segs.append((content + eot, trained))
        done, prev = gen + region[: idx + len(content) + len(eot)], full
    tail = render_text(tokenizer, messages, add_generation_prompt, context)
    if not tail.startswith(done):
        raise Malformed("template not prefix-consistent: full rendering differs from its prefixes")
    if len(tail) > len(done):
        segs.append((tail[len(done):], False))
    return [(t, m) for t, m in segs if t]


SENTINEL = "\x00specheads-turn\x00"  # probe text of a plain assistant turn: what follows it closes a turn


def _agentic_span(tokenizer, messages: list[dict], i: int, gen: str, prev: str, region: str, specials: list[str],
                  context: dict) -> tuple[int, str]:
    """(end of the assistant's own text in `region`, its end-of-turn token) for assistant turn i with tool calls or
    reasoning. `region` is what the template renders after the generation prompt: all of it up to the turn's
    closing is the target's output (reasoning, text, tool calls however the template tags them). The closing is
    found by rendering a plain probe turn in the same place (`<|im_end|>\\n` for ChatML), else as the last special
    token followed by whitespace only (templates that close a tool-call turn differently: Llama 3.1's
    <|eom_id|>). Every tool call's function name must be in the span (a template that drops tool_calls: Malformed)."""
    if gen == prev:
        raise Malformed("template has no generation prompt: cannot locate a tool-call or reasoning turn")
    probe = render_text(tokenizer, messages[:i] + [{"role": "assistant", "content": SENTINEL}], context=context)
    closing = probe[probe.rfind(SENTINEL) + len(SENTINEL):] if SENTINEL in probe else ""
    if closing and region.endswith(closing):
        end, eot = len(region) - len(closing), next((s for s in specials if closing.startswith(s)), "")
    else:
        ends = [(region.rfind(s), s) for s in specials if s in region and not region[region.rfind(s) + len(s):].strip()]
        end, eot = max(ends) if ends else (len(region.rstrip()), "")
    names = [c["function"]["name"] for c in template_message(messages[i]).get("tool_calls", [])]
    missing = [n for n in names if n not in region[:end]]
    if missing:
        raise Malformed(f"the chat template does not render tool_calls (function {missing[0]!r} is not in the "
                        f"assistant turn)")
    return end, eot


def tokenize_conversations(conversations, tokenizer, max_length: int, batch_size: int = 64, desc: str = "tokenize"):
    """Conversations -> Dataset[input_ids, loss_mask, conversation_id] (+ stats dict).

    Samples longer than `max_length` are cut; samples whose mask is empty (e.g. the assistant turn starts after the
    cut) are dropped and counted."""
    import datasets

    specials = special_tokens(tokenizer)
    bad: list[str] = []

    def fn(batch):
        out = {"input_ids": [], "loss_mask": [], "conversation_id": [], "_status": []}
        pieces: list[str] = []
        plan: list[list[tuple[int, bool]] | None] = []
        ctx_cols = [k for k in CONTEXT_FIELDS if k in batch]
        for j, (cid, msgs) in enumerate(zip(batch["conversation_id"], batch["messages"])):
            try:
                context = context_kwargs({k: batch[k][j] for k in ctx_cols})
                segs = render_segments(tokenizer, msgs, specials, context=context)
            except Malformed as e:
                plan.append(None)
                if len(bad) < SHOW_REASONS:
                    bad.append(f"{cid}: {e}")
                continue
            entry = []
            for t, m in segs:  # text: encoded in one batch below (its index in pieces); ids: kept as they are
                if isinstance(t, str):
                    pieces.append(t)
                    t = len(pieces) - 1
                entry.append((t, m))
            plan.append(entry)
        enc = tokenizer(pieces, add_special_tokens=False)["input_ids"] if pieces else []
        for cid, p in zip(batch["conversation_id"], plan):
            ids: list[int] = []
            mask: list[int] = []
            if p is not None:
                for k, m in p:
                    seg = enc[k] if isinstance(k, int) else k
                    ids.extend(seg)
                    mask.extend([int(m)] * len(seg))
            status = "template" if p is None else ("ok" if len(ids) <= max_length else "cut")
            ids, mask = ids[:max_length], mask[:max_length]
            if p is not None and not any(mask):
                status = "empty_mask"
            out["input_ids"].append(ids)
            out["loss_mask"].append(mask)
            out["conversation_id"].append(cid)
            out["_status"].append(status)
        return out

    feats = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                               "loss_mask": datasets.List(datasets.Value("int8")),
                               "conversation_id": datasets.Value("string"),
                               "_status": datasets.Value("string")})
    tok = conversations.map(fn, batched=True, batch_size=batch_size, remove_columns=conversations.column_names,
                            features=feats, desc=desc)
    status = collections.Counter(tok["_status"])
    tok = tok.filter(lambda s: s in ("ok", "cut"), input_columns="_status", desc="drop empty").remove_columns("_status")
    lengths = [len(x) for x in tok["input_ids"]]
    masked = sum(sum(m) for m in tok["loss_mask"])
    stats = {"samples": len(tok), "truncated": status["cut"], "dropped_empty_mask": status["empty_mask"],
             "dropped_template": status["template"], "tokens": sum(lengths), "masked_tokens": masked,
             "max_length": max_length}
    if status["empty_mask"]:
        log.info("dropped %d samples whose loss mask was empty after truncation to %d tokens", status["empty_mask"],
                 max_length)
    if bad:
        log.warning("dropped %d conversations the chat template could not split: %s", status["template"],
                    "; ".join(bad))
    return tok, stats


# ------------------------------------------------------------------------------------- templates for any target

NO_TEMPLATE = ("target {target}: its tokenizer has no chat template (a base model?), so data.source's conversations "
               "cannot be rendered; give data.chat_template (a Jinja template file or the template text), or train "
               "on plain text with data.mode=text (rows {{\"text\": ...}} or a .txt file, loss on every token)")


def check_mode_settings(cfg: DataConfig) -> None:
    """The data.mode / chat_template / regen_prefix_tokens combinations that mean something (one error otherwise)."""
    if cfg.mode == "text":
        for key in ("chat_template", "chat_template_kwargs"):
            if getattr(cfg, key) is not None:
                raise SpecheadsError(f"data.{key}: set, but data.mode is text (plain text is not templated)")
        if cfg.regen_max_turns is not None:
            raise SpecheadsError("data.regen_max_turns: counts conversation turns; data.mode is text")
    too_long = cfg.mode == "text" and cfg.regenerate and cfg.regen_prefix_tokens >= cfg.max_length
    if cfg.regen_prefix_tokens < 1 or too_long:
        raise SpecheadsError(f"data.regen_prefix_tokens: must be in 1..data.max_length-1 ({cfg.max_length - 1}), "
                             f"got {cfg.regen_prefix_tokens}")


def chat_tokenizer(tokenizer, chat_template: str | None, target_name: str, chat_kwargs: dict | None = None):
    """The tokenizer conversations are rendered with: a copy carrying `chat_template` (data.chat_template: a file
    path, or the template text when it holds Jinja tags) when given, else the target's own; with
    `chat_kwargs` (data.chat_template_kwargs) a copy that carries them (utils.CHAT_KWARGS_ATTR, read by
    render_text and target.chat_prompt_ids: every rendering of the data). A target without any template is one
    SpecheadsError naming it and both fixes, not transformers' ValueError from apply_chat_template."""
    import copy

    if tokenizer is None:
        raise SpecheadsError(f"target {target_name}: has no tokenizer (needed to tokenize data.source)")
    if chat_kwargs:
        tokenizer = copy.deepcopy(tokenizer)
        setattr(tokenizer, CHAT_KWARGS_ATTR, dict(chat_kwargs))
    if chat_template is None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise SpecheadsError(NO_TEMPLATE.format(target=target_name))
        return tokenizer
    text = chat_template
    if "{%" not in chat_template and "{{" not in chat_template:  # no Jinja tag: a file
        path = Path(chat_template).expanduser()
        if not path.is_file():
            raise SpecheadsError(f"data.chat_template {chat_template!r}: no such file (and no Jinja tags, so not a "
                                 f"template text either)")
        text = path.read_text(encoding="utf-8")
    tok = tokenizer if chat_kwargs else copy.deepcopy(tokenizer)  # already a copy when it carries the kwargs
    tok.chat_template = text
    probe = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    try:
        tok.apply_chat_template(probe, tokenize=False, **(chat_kwargs or {}))
        tok.apply_chat_template(probe[:1], tokenize=False, add_generation_prompt=True, **(chat_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - jinja errors of many kinds: one line naming the field
        raise SpecheadsError(f"data.chat_template: cannot render a conversation ({type(e).__name__}: {e})") from None
    return tok


def tokenize_texts(texts, tokenizer, max_length: int, batch_size: int = 64, desc: str = "tokenize text"):
    """Texts -> Dataset[input_ids, loss_mask (all 1), conversation_id] (+ stats with tokenize_conversations' keys).

    Each text is encoded as a plain prompt is (`add_special_tokens=True`, as `generate --raw` and bench's
    completions do) and cut into consecutive windows of `max_length` tokens: window k of text `x` is sample `x` (k =
    0) or `x#k`, so a long file loses nothing. Windows under 2 tokens hold no prediction and are dropped, counted."""
    import datasets

    def fn(batch):
        out = {"input_ids": [], "loss_mask": [], "conversation_id": [], "_split": []}
        enc = tokenizer(list(batch["text"]), add_special_tokens=True)["input_ids"]
        for cid, ids in zip(batch["conversation_id"], enc):
            for k, start in enumerate(range(0, len(ids), max_length)):
                window = ids[start:start + max_length]
                out["input_ids"].append(window)
                out["loss_mask"].append([1] * len(window))
                out["conversation_id"].append(cid if k == 0 else f"{cid}#{k}")
                out["_split"].append(int(len(ids) > max_length and k == 0))
        return out

    feats = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                               "loss_mask": datasets.List(datasets.Value("int8")),
                               "conversation_id": datasets.Value("string"), "_split": datasets.Value("int8")})
    tok = texts.map(fn, batched=True, batch_size=batch_size, remove_columns=texts.column_names, features=feats,
                    desc=desc)
    split = sum(tok["_split"])
    before = len(tok)
    tok = tok.filter(lambda ids: len(ids) >= 2, input_columns="input_ids", desc="drop short").remove_columns("_split")
    n_tokens = sum(len(x) for x in tok["input_ids"])
    stats = {"samples": len(tok), "truncated": 0, "split_texts": split, "dropped_empty_mask": before - len(tok),
             "dropped_template": 0, "tokens": n_tokens, "masked_tokens": n_tokens, "max_length": max_length}
    if split:
        log.info("%d texts longer than %d tokens were cut into windows of that length", split, max_length)
    return tok, stats
