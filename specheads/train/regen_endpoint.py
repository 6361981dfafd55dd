"""Regeneration through a serving engine: an OpenAI-compatible endpoint (vLLM, SGLang, llama-server) answers instead
of our own decoders (`data.regen_endpoint`; train/regenerate.py keeps the rest: the resume file, source order,
per-answer seeds).

Two ways to ask (`data.regen_api`):
- `completions` (default): POST {endpoint}/completions with `prompt` = the token ids of OUR rendering of the
  conversation (history_prompt_ids: the target's chat template with data.chat_template / chat_template_kwargs,
  earlier answers as the ids the target generated), so the prompt the server continues is exactly the one the
  head trains on; the server applies no template.
- `chat`: POST {endpoint}/chat/completions with the conversation's messages (and tools / documents /
  chat_template_kwargs); the SERVER applies its own template (llama-server's --jinja or built-in one, vLLM's
  tokenizer's), which may differ from ours: each row records `"template": "server"`.

Token ids: each answer keeps the ids the server generated where its reply holds them: vLLM's `token_ids`
(`return_token_ids`), llama-server's `__verbose.tokens` (`verbose` + `return_tokens`: its OpenAI replies carry no
ids otherwise; tools/server/server-task.cpp), a native `tokens` field, or the `id` of each `logprobs.content` entry.
A server that returns only text gets one warning line and its answers are re-encoded with our tokenizer (which can
change tokens); each row records where its ids came from (`regenerated_by.token_ids`: "server" or "retokenized").
The end-of-generation token that stopped an answer is dropped, as in our own regeneration.

Requests: `data.regen_concurrency` at a time (threads), answers handed back in the order they were asked (so the
resume file is written in source order). A connection error, a timeout (`data.regen_timeout_s`), HTTP 408 / 429 /
5xx is retried `data.regen_retries` times with exponential backoff (BACKOFF_S, doubled per try, at most
MAX_BACKOFF_S); then, or at once for any other HTTP error or a reply that is not a completion, one error naming the
endpoint. Every request carries a seed (regenerate.answer_seed: run seed, conversation id, turn), so where the
server honours seeds a resumed sampled run equals an uninterrupted one; greedy needs none.
"""
from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Sequence

from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)

BACKOFF_S = 0.5  # first wait before a retry (s); doubled each further try
MAX_BACKOFF_S = 30.0  # longest single wait (s)
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})  # the server is busy or failing, not refusing the request
SEED_MOD = (1 << 31) - 1  # llama.cpp reads seed as uint32 and 0xFFFFFFFF means "random": stay below 2**31
APIS = ("completions", "chat")
Work = tuple[Hashable, list[int], int, int]  # as regenerate.Work: (key, prompt ids, max new tokens, seed)


@dataclass(frozen=True)
class EndpointSettings:
    url: str  # the OpenAI base, e.g. http://127.0.0.1:8080/v1 (requests go to {url}/completions)
    model: str | None = None  # the request's `model` (None: left out, the server's own model)
    api: str = "completions"
    concurrency: int = 8
    timeout_s: float = 600.0
    retries: int = 5
    backoff_s: float = BACKOFF_S
    chat_template_kwargs: dict | None = None  # chat api: passed to the server's template

    @classmethod
    def from_data(cls, dc) -> "EndpointSettings":
        return cls(url=dc.regen_endpoint.rstrip("/"), model=dc.regen_model, api=dc.regen_api,
                   concurrency=dc.regen_concurrency, timeout_s=dc.regen_timeout_s, retries=dc.regen_retries,
                   chat_template_kwargs=dc.chat_template_kwargs)

    def describe(self) -> str:
        how = "our chat template, token ids" if self.api == "completions" else "the server's chat template"
        return f"the endpoint {self.url} ({self.api}: {how}; {self.concurrency} at a time)"


def check_endpoint_url(url: Any) -> None:
    """data.regen_endpoint: an http(s) URL with a host (one error otherwise)."""
    from urllib.parse import urlparse

    p = urlparse(url) if isinstance(url, str) else None
    if p is None or p.scheme not in ("http", "https") or not p.netloc:
        raise SpecheadsError(f"data.regen_endpoint: expected an http(s) URL such as http://127.0.0.1:8080/v1, "
                             f"got {url!r}")


def check_endpoint_settings(cfg) -> None:
    """data.regen_endpoint and the settings it makes moot or needs (one error otherwise)."""
    if cfg.regen_endpoint is None:
        return
    check_endpoint_url(cfg.regen_endpoint)
    if not cfg.regenerate:
        raise SpecheadsError("data.regen_endpoint: set, but data.regenerate is false (nothing to regenerate)")
    if cfg.mode == "text" and cfg.regen_api == "chat":
        raise SpecheadsError("data.regen_api: chat has the server apply a chat template; data.mode text continues "
                             "plain windows (use regen_api: completions)")


class _Retry(Exception):
    """One failed try that may succeed later (connection, timeout, 408 / 429 / 5xx)."""


def post_once(url: str, body: dict, timeout_s: float) -> dict:
    """One POST of `body` as JSON -> the JSON reply; raises _Retry or SpecheadsError."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:300].decode("utf-8", "replace")
        if e.code in RETRY_STATUS:
            raise _Retry(f"HTTP {e.code}: {detail}") from None
        raise SpecheadsError(f"data.regen_endpoint {url}: HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException, OSError) as e:
        raise _Retry(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None
    try:
        reply = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise SpecheadsError(f"data.regen_endpoint {url}: the reply is not JSON: {raw[:200]!r}") from None
    if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list) or not reply["choices"]:
        raise SpecheadsError(f"data.regen_endpoint {url}: the reply holds no choices (not an OpenAI completion): "
                             f"{str(reply)[:200]}")
    return reply


def post_with_retries(s: EndpointSettings, url: str, body: dict, sleep: Callable[[float], None] = time.sleep
                      ) -> dict:
    """post_once, retried s.retries times with exponential backoff; then one error naming the endpoint."""
    last = ""
    for attempt in range(s.retries + 1):
        if attempt:
            sleep(min(MAX_BACKOFF_S, s.backoff_s * 2 ** (attempt - 1)))
        try:
            return post_once(url, body, s.timeout_s)
        except _Retry as e:
            last = str(e)
    tries = f"{s.retries + 1} {'try' if s.retries == 0 else 'tries'}"
    raise SpecheadsError(f"data.regen_endpoint {url}: no answer after {tries} (last: {last}); is the server "
                         f"running? (data.regen_retries, data.regen_timeout_s)")


def reply_answer(reply: dict, api: str) -> tuple[str, list[int] | None, str | None]:
    """(text, token ids or None when the reply holds none, finish_reason) of a completion reply."""
    choice = reply["choices"][0]
    if not isinstance(choice, dict):
        raise SpecheadsError(f"a reply's choice is a {type(choice).__name__}, not an object")
    text = choice.get("text") if api == "completions" else (choice.get("message") or {}).get("content")
    text = text if isinstance(text, str) else ""
    verbose = reply.get("__verbose") if isinstance(reply.get("__verbose"), dict) else {}
    lp = choice.get("logprobs") if isinstance(choice.get("logprobs"), dict) else {}
    content = lp.get("content") if isinstance(lp.get("content"), list) else None
    by_probs = [c.get("id") for c in content] if content and all(isinstance(c, dict) for c in content) else None
    for ids in (choice.get("token_ids"), verbose.get("tokens"), reply.get("tokens"), by_probs):
        if isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids) \
                and (ids or not text):
            return text, [int(t) for t in ids], choice.get("finish_reason")
    return text, None, choice.get("finish_reason")


class EndpointDecoder:
    """regenerate.decode_answers' contract over an endpoint: `(work, temperature, top_p)` -> (key, new token ids)
    in work's order. `messages_of(key)`: the conversation so far (chat api); `context_of(key)`: its tools= /
    documents=. `sources[key]`: where each of its answers' ids came from ("server" / "retokenized")."""

    def __init__(self, s: EndpointSettings, tok, stop_ids: Sequence[int],
                 messages_of: Callable[[Hashable], list[dict]] | None = None,
                 context_of: Callable[[Hashable], dict] | None = None):
        self.s, self.tok, self.stop_ids = s, tok, set(int(t) for t in stop_ids)
        self.messages_of, self.context_of = messages_of, context_of
        self.path = s.url + ("/completions" if s.api == "completions" else "/chat/completions")
        self.sources: dict[Hashable, list[str]] = {}
        self.model_seen: str | None = None
        self._warned = False
        self._lock = threading.Lock()

    def body(self, key: Hashable, prompt: list[int], cap: int, seed: int, temperature: float, top_p: float) -> dict:
        b: dict[str, Any] = {"max_tokens": int(cap), "seed": int(seed) % SEED_MOD, "stream": False,
                             "return_token_ids": True,  # vLLM: choices[0].token_ids
                             "return_tokens": True, "verbose": True}  # llama-server: __verbose.tokens
        if self.s.model is not None:
            b["model"] = self.s.model
        if temperature <= 0:
            b["temperature"] = 0.0  # greedy on every server
        else:  # plain sampling: llama.cpp's default top-k 40 / min-p 0.05 switched off (-1 = off on vLLM too)
            b.update(temperature=float(temperature), top_p=float(top_p), top_k=-1, min_p=0.0)
        if self.s.api == "completions":
            b["prompt"] = [int(t) for t in prompt]
            return b
        b["messages"] = [chat_message(m) for m in self.messages_of(key)]
        b.update((self.context_of(key) if self.context_of else {}) or {})
        if self.s.chat_template_kwargs:
            b["chat_template_kwargs"] = dict(self.s.chat_template_kwargs)
        return b

    def answer(self, key: Hashable, reply: dict, cap: int) -> list[int]:
        text, ids, finish = reply_answer(reply, self.s.api)
        source = "server"
        if ids is None:
            source = "retokenized"
            ids = [int(t) for t in self.tok(text, add_special_tokens=False)["input_ids"]]
            with self._lock:
                if not self._warned:
                    self._warned = True
                    log.warning("%s returns text only, no token ids: its answers are re-encoded with our "
                                "tokenizer (which can change tokens); rows say regenerated_by.token_ids: "
                                "retokenized", self.path)
        elif finish == "stop" and ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]  # the end-of-generation token that stopped it (our regeneration drops it too)
        with self._lock:
            self.sources.setdefault(key, []).append(source)
            self.model_seen = self.model_seen or (reply.get("model") if isinstance(reply.get("model"), str)
                                                  else None)
        return ids[:cap]

    def __call__(self, work: Sequence[Work], temperature: float = 0.0, top_p: float = 1.0
                 ) -> Iterator[tuple[Hashable, list[int]]]:
        def one(item: Work) -> list[int]:
            key, prompt, cap, seed = item
            return self.answer(key, post_with_retries(self.s, self.path, self.body(key, prompt, cap, seed,
                                                                                  temperature, top_p)), cap)

        yield from zip((item[0] for item in work), in_order(one, list(work), self.s.concurrency))

    def row_meta(self, key: Hashable) -> dict:
        """What a written row records about how it was regenerated (popped: the row is written once)."""
        src = self.sources.pop(key, [])
        return {"endpoint": self.s.url, "api": self.s.api, "model": self.s.model or self.model_seen,
                "template": "specheads" if self.s.api == "completions" else "server",
                "token_ids": "server" if src and all(x == "server" for x in src) else "retokenized"}


def in_order(fn: Callable, items: list, n: int) -> Iterator:
    """fn(item) for every item, n at a time on daemon threads, yielded in items' order (an item that finished early
    waits for those before it); the first failure is raised in order. Daemon threads: a Ctrl-C or an error does not
    wait for the requests still in flight (a pool's threads would be joined at exit, each up to its timeout)."""
    results: list = [None] * len(items)
    done = [threading.Event() for _ in items]
    order, lock, stop = iter(range(len(items))), threading.Lock(), threading.Event()

    def worker() -> None:
        while not stop.is_set():
            with lock:
                i = next(order, None)
            if i is None:
                return
            try:
                results[i] = (True, fn(items[i]))
            except BaseException as e:  # noqa: BLE001 - handed to the caller, in order
                results[i] = (False, e)
            done[i].set()

    for _ in range(min(n, len(items))):
        threading.Thread(target=worker, daemon=True, name="regen-endpoint").start()
    try:
        for i in range(len(items)):
            done[i].wait()
            ok, value = results[i]
            if not ok:
                raise value
            yield value
    finally:
        stop.set()  # the workers take no new item


def chat_message(m: dict) -> dict:
    """A history message as the chat api takes it: no token_ids or loss flags."""
    return {k: v for k, v in m.items() if k in ("role", "content", "tool_calls", "tool_call_id", "name",
                                                "reasoning_content") and v is not None}
