"""Regeneration through an OpenAI-compatible endpoint (train/regen_endpoint.py), against a fake server in a thread
(tests/fake_openai.py: answers a pure function of the request; failures, concurrency and order planned, nothing
timed) and, marked slow, against a real llama-server serving the bundled target with 4 parallel slots."""
from __future__ import annotations

import json
import logging
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from fake_openai import END_ID, FakeOpenAI, answer_ids
from specheads.train.regen_endpoint import MAX_BACKOFF_S, EndpointSettings, post_with_retries
from specheads.train.regenerate import regenerate, regenerate_texts
from specheads.utils import SpecheadsError


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from specheads.target import resolve_target_path

    return AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m"))


def _target(tok):
    """What regenerate needs of a target when a server answers: its tokenizer and end-of-sequence ids."""
    return SimpleNamespace(tokenizer=tok, name="smollm2-135m", eos_token_ids=[END_ID])


def _convs(n: int) -> list[dict]:
    """n conversations; every third has two exchanges (its second answer waits for the next wave)."""
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": "old answer"}]
        if i % 3 == 2:
            msgs += [{"role": "user", "content": f"And then {i}?"}, {"role": "assistant", "content": "old"}]
        out.append({"conversation_id": f"c{i}", "messages": msgs})
    return out


def _settings(srv, **kw) -> EndpointSettings:
    return EndpointSettings(**{"url": srv.url if hasattr(srv, "url") else srv, "concurrency": 4, "timeout_s": 10.0,
                               "retries": 2, "backoff_s": 0.0, **kw})


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


@pytest.mark.parametrize("ids", ["vllm", "llama", "logprobs"])
def test_server_ids_kept_in_source_order(tmp_path, tok, ids):
    out = tmp_path / "regen.jsonl"
    with FakeOpenAI(tok, ids=ids, delay_first_s=0.3) as srv:  # the first request answers last
        stats = regenerate(_target(tok), _convs(9), out, max_length=256, max_new_tokens=6, batch_size=2,
                           progress=False, endpoint=_settings(srv))
    rows = _rows(out)
    assert [r["id"] for r in rows] == [f"c{i}" for i in range(9)]
    assert stats["regenerated"] == 9 and len(srv.requests) == 12  # 9 first turns + 3 second turns
    want = {}
    for body in srv.requests:  # what the server generated for each prompt, its END_ID dropped
        got, finish = answer_ids(json.dumps(body["prompt"]), body["max_tokens"], body["seed"], body["temperature"])
        want[tuple(body["prompt"])] = [t for t in got if t != END_ID]
    text = tok.apply_chat_template([{"role": "user", "content": "Question 0?"}], add_generation_prompt=True,
                                   tokenize=False)
    assert tok(text, add_special_tokens=False)["input_ids"] in [b["prompt"] for b in srv.requests]  # our template
    answers = [m for r in rows for m in r["messages"] if m["role"] == "assistant"]
    assert sorted(map(tuple, (m["token_ids"] for m in answers))) == sorted(map(tuple, want.values()))
    assert all(m["content"] == tok.decode(m["token_ids"], skip_special_tokens=True) for m in answers)
    assert {r["regenerated_by"]["token_ids"] for r in rows} == {"server"}
    assert rows[0]["regenerated_by"] == {"endpoint": srv.url, "api": "completions", "model": "fake-model",
                                         "template": "specheads", "token_ids": "server"}


def test_text_only_server_is_said_and_retokenized(tmp_path, tok, caplog):
    out = tmp_path / "regen.jsonl"
    with caplog.at_level(logging.WARNING), FakeOpenAI(tok, ids="text") as srv:
        regenerate(_target(tok), _convs(4), out, max_new_tokens=6, batch_size=2, progress=False,
                   endpoint=_settings(srv))
    said = [r for r in caplog.records if "returns text only" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    for r in _rows(out):
        assert r["regenerated_by"]["token_ids"] == "retokenized"
        for m in r["messages"]:
            if m["role"] == "assistant":
                assert m["token_ids"] == tok(m["content"], add_special_tokens=False)["input_ids"]


def test_requests_run_concurrently(tmp_path, tok):
    # the first 4 requests wait for each other at a barrier: a client sending fewer at once breaks it (HTTP 500,
    # which retries=0 turns into an error)
    with FakeOpenAI(tok, barrier=4) as srv:
        regenerate(_target(tok), _convs(8), tmp_path / "r.jsonl", max_new_tokens=4, batch_size=2, progress=False,
                   endpoint=_settings(srv, retries=0))
    assert srv.max_inflight == 4  # and never more than data.regen_concurrency


def test_retries_back_off_exponentially(tok):
    waits: list[float] = []
    with FakeOpenAI(tok, plan=[503, "drop", 502]) as srv:
        s = _settings(srv, retries=3, backoff_s=0.5)
        reply = post_with_retries(s, srv.url + "/completions", {"prompt": [1, 2], "max_tokens": 3}, sleep=waits.append)
    assert reply["choices"][0]["finish_reason"] in ("stop", "length")
    assert len(srv.requests) == 4 and waits == [0.5, 1.0, 2.0]
    waits.clear()
    with pytest.raises(SpecheadsError):
        post_with_retries(_settings(_closed_port(), retries=5, backoff_s=10.0), _closed_port() + "/completions", {},
                          sleep=waits.append)
    assert waits == [10.0, 20.0, MAX_BACKOFF_S, MAX_BACKOFF_S, MAX_BACKOFF_S]  # doubled, then capped


def test_gives_up_with_one_error_naming_the_endpoint(tmp_path, tok):
    url = _closed_port()
    with pytest.raises(SpecheadsError, match=rf"data.regen_endpoint {url}/completions: no answer after 3 tries "
                                             r"\(last: URLError"):
        regenerate(_target(tok), _convs(2), tmp_path / "r.jsonl", progress=False, endpoint=_settings(url))


def test_client_errors_are_not_retried(tok):
    with FakeOpenAI(tok, plan=[400]) as srv:
        with pytest.raises(SpecheadsError, match=r"/completions: HTTP 400: .*planned 400"):
            post_with_retries(_settings(srv, retries=3), srv.url + "/completions", {"prompt": [1], "max_tokens": 1})
    assert len(srv.requests) == 1


def test_a_timeout_is_retried(tok):
    with FakeOpenAI(tok, plan=[("sleep", 1.5)]) as srv:
        reply = post_with_retries(_settings(srv, timeout_s=0.3, retries=1), srv.url + "/completions",
                                  {"prompt": [1], "max_tokens": 2})
    assert reply["choices"] and len(srv.requests) == 2


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_resume_after_a_failure_equals_one_run(tmp_path, tok, temperature):
    args = dict(max_new_tokens=6, batch_size=2, temperature=temperature, seed=7, progress=False)
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    with FakeOpenAI(tok) as srv:  # one server throughout: each row records the endpoint it came from
        regenerate(_target(tok), _convs(12), whole, endpoint=_settings(srv), **args)
        srv.fail_after = srv.answered + 5  # the server fails after 5 more answers: the run stops with an error
        with pytest.raises(SpecheadsError, match="no answer after 1 try "):
            regenerate(_target(tok), _convs(12), cut, endpoint=_settings(srv, retries=0), **args)
        lines = cut.read_text().splitlines(keepends=True)
        assert 0 < len(lines) < 12 and lines == whole.read_text().splitlines(keepends=True)[:len(lines)]  # a prefix
        with open(cut, "a") as f:
            f.write('{"id": "c11", "messa')  # and a line cut by a kill
        srv.fail_after = None
        regenerate(_target(tok), _convs(12), cut, endpoint=_settings(srv), **args)
        assert cut.read_bytes() == whole.read_bytes()
        if temperature > 0:  # the seeds reach the server: sampled answers differ from greedy ones
            regenerate(_target(tok), _convs(12), tmp_path / "g.jsonl", endpoint=_settings(srv),
                       **dict(args, temperature=0.0))
            assert (tmp_path / "g.jsonl").read_bytes() != whole.read_bytes()


def test_chat_api_sends_messages_and_records_the_server_template(tmp_path, tok):
    with FakeOpenAI(tok) as srv:
        regenerate(_target(tok), _convs(3), tmp_path / "r.jsonl", max_new_tokens=6, progress=False,
                   endpoint=_settings(srv, api="chat", chat_template_kwargs={"enable_thinking": False}))
    rows = _rows(tmp_path / "r.jsonl")
    assert all(r["regenerated_by"]["template"] == "server" and r["regenerated_by"]["api"] == "chat" for r in rows)
    second = [b for b in srv.requests if len(b["messages"]) == 3]
    assert len(second) == 1 and second[0]["_path"] == "/v1/chat/completions"
    first_answer = rows[2]["messages"][1]
    assert second[0]["messages"][1] == {"role": "assistant", "content": first_answer["content"]}  # no token_ids
    assert all(b["chat_template_kwargs"] == {"enable_thinking": False} for b in srv.requests)


def test_text_mode_continues_windows_through_the_endpoint(tmp_path, tok):
    samples = {"conversation_id": ["a", "b", "c"], "input_ids": [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15]]}
    out = tmp_path / "t.jsonl"
    with FakeOpenAI(tok, delay_first_s=0.2) as srv:
        regenerate_texts(_target(tok), samples, out, prefix_tokens=3, max_length=12, batch_size=2, progress=False,
                         endpoint=_settings(srv))
    rows = _rows(out)
    assert [r["id"] for r in rows] == ["a", "b", "c"]
    for r, body in zip(rows, sorted(srv.requests, key=lambda b: b["prompt"])):
        got, _ = answer_ids(json.dumps(body["prompt"]), body["max_tokens"], body["seed"], 0.0)
        assert r["input_ids"] == body["prompt"] + [t for t in got if t != END_ID]
        assert r["regenerated_by"]["token_ids"] == "server"


# ----------------------------------------------------------------------------------- a real llama-server (slow)

def _llama_missing() -> str:
    from specheads.heads.gguf import find_tools

    try:
        find_tools("llama-server", converter=True)
        return ""
    except SpecheadsError as e:
        return str(e)


needs_llama = pytest.mark.skipif(bool(_llama_missing()), reason=f"no llama-server: {_llama_missing()}")
KILL_SCRIPT = """
import json, sys
from types import SimpleNamespace
from transformers import AutoTokenizer
from specheads.target import resolve_target_path
from specheads.train.regen_endpoint import EndpointSettings
from specheads.train.regenerate import regenerate
convs, out, url = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
tok = AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m"))
target = SimpleNamespace(tokenizer=tok, name="smollm2-135m", eos_token_ids=[2])
regenerate(target, convs, out, max_new_tokens=24, batch_size=1, max_turns=1, progress=False,
           endpoint=EndpointSettings(url=url, concurrency=4))
"""


@pytest.fixture(scope="module")
def llama():
    from specheads.heads.gguf import target_gguf
    from specheads.infer.bench.llamacpp import LlamaServer

    with LlamaServer(target_gguf("smollm2-135m"), parallel=4, ctx_size=4 * 1024) as srv:
        yield srv


@pytest.fixture(scope="module")
def sharegpt():
    from specheads.conversations.load import load_conversations

    convs, _ = load_conversations("sharegpt", 12)
    return [{"conversation_id": c["conversation_id"], "messages": c["messages"]} for c in convs]


@pytest.mark.slow
@needs_llama
def test_llama_server_ids_are_the_servers_tokens(tmp_path, tok, llama, sharegpt):
    from specheads.target import load_target
    from specheads.train.regenerate import stop_ids

    target = load_target("smollm2-135m")
    out = tmp_path / "r.jsonl"
    regenerate(target, sharegpt[:8], out, max_length=1024, max_new_tokens=24, max_turns=1, progress=False,
               endpoint=_settings(llama.url + "/v1", timeout_s=300.0))
    rows = _rows(out)
    assert len(rows) == 8 and {r["regenerated_by"]["token_ids"] for r in rows} == {"server"}
    stops = set(stop_ids(target, tok))
    for r in rows:  # the same prompt once more, on its own, through the native /completion endpoint
        prompt = tok(tok.apply_chat_template(r["messages"][:-1], add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"]
        reply = llama.complete(prompt, 24)
        ids = reply["tokens"][:-1] if reply["tokens"] and reply["tokens"][-1] in stops else reply["tokens"]
        assert r["messages"][-1]["token_ids"] == ids, r["id"]
        assert tok.decode(ids, skip_special_tokens=True) == reply["content"]  # the ids re-decoded: its text


@pytest.mark.slow
@needs_llama
def test_llama_server_killed_and_resumed_equals_one_run(tmp_path, tok, llama, sharegpt):
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "convs.json").write_text(json.dumps(sharegpt))
    url = llama.url + "/v1"
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    run = [sys.executable, "-c", KILL_SCRIPT, str(tmp_path / "convs.json")]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    subprocess.run(run + [str(whole), url], env=env, check=True, timeout=600)
    proc = subprocess.Popen(run + [str(cut), url], env=env)
    deadline = time.monotonic() + 600  # not a timing assertion: only a bound on the wait for a first row
    while proc.poll() is None and time.monotonic() < deadline and \
            not (cut.exists() and cut.read_text().count("\n") >= 2):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    kept_rows = cut.read_text().splitlines(keepends=True)
    kept_rows = kept_rows[:-1] if kept_rows and not kept_rows[-1].endswith("\n") else kept_rows
    assert 2 <= len(kept_rows) < len(sharegpt), f"the kill came at {len(kept_rows)} rows"
    subprocess.run(run + [str(cut), url], env=env, check=True, timeout=600)
    resumed, one = _rows(cut), _rows(whole)
    assert [r["id"] for r in resumed] == [r["id"] for r in one]  # every conversation once, in source order
    assert cut.read_text().splitlines(keepends=True)[:len(kept_rows)] == kept_rows  # the killed run's rows kept
    differ = [r["id"] for r, w in zip(resumed, one) if r != w]
    if differ:  # measured: 1 of 12 answers (token 19 of 24) on this CPU; our requests are the same (fake server)
        pytest.xfail(f"llama-server with 4 slots answered {len(differ)} of {len(one)} identical requests "
                     f"differently (its results depend on what else it batches): {differ}")
    assert cut.read_bytes() == whole.read_bytes()
