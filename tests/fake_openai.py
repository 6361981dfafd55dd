"""A tiny OpenAI-compatible server on 127.0.0.1 (http.server in a thread) for the regeneration-from-an-endpoint
tests (tests/test_regen_endpoint.py) and reliability cases (scripts/reliability_r4_endpoint.py, which imports the
module as tests.fake_openai).

Its answers are a pure function of the request: `answer_ids(prompt key, max_tokens, seed, temperature)`, ordinary
SmolLM2 tokens (1000..1999), 3..7 of them; an answer shorter than max_tokens ends with END_ID (finish "stop"), as a
server that stopped on end-of-generation reports it. `ids`: how the reply carries token ids: "vllm"
(choices[0].token_ids), "llama" (__verbose.tokens, as llama-server with verbose + return_tokens), "logprobs"
(logprobs.content[].id) or "text" (none). `plan`: what the next requests get, popped one per request: an int (that
HTTP status), "drop" (the connection closed without a reply), ("sleep", s) before answering; `fail_after`: every
request after that many answers gets HTTP 500. `barrier`: the first `barrier` requests wait for each other (a
client that sends fewer at once breaks it: HTTP 500), so concurrency is checked without timing anything.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

END_ID = 2  # SmolLM2's <|im_end|>


def answer_ids(key: str, max_tokens: int, seed: int, temperature: float) -> tuple[list[int], str]:
    """(ids with END_ID when it stopped, finish_reason): greedy ignores the seed, sampling depends on it."""
    h = hashlib.sha256(f"{key}|{seed if temperature > 0 else '-'}".encode()).digest()
    n = 3 + h[0] % 5
    ids = [1000 + (h[1 + i] * 7 + i) % 1000 for i in range(min(n, max_tokens))]
    return (ids + [END_ID], "stop") if n < max_tokens else (ids, "length")


class _Quiet(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:  # a client that hung up (a timeout test): no trace
        pass


class FakeOpenAI:
    def __init__(self, tok, ids: str = "vllm", plan=(), fail_after: int | None = None, barrier: int = 0,
                 delay_first_s: float = 0.0):
        self.tok, self.ids, self.plan, self.fail_after = tok, ids, list(plan), fail_after
        self.requests: list[dict] = []
        self.answered = 0
        self.inflight = self.max_inflight = 0
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(barrier, timeout=20) if barrier > 1 else None
        self.delay_first_s = delay_first_s  # the first request answers last (order checks)
        self.httpd = _Quiet(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "FakeOpenAI":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def reply(self, body: dict, path: str) -> dict:
        chat = path.endswith("/chat/completions")
        key = json.dumps(body["messages"] if chat else body["prompt"])
        ids, finish = answer_ids(key, int(body["max_tokens"]), int(body.get("seed", 0)),
                                 float(body.get("temperature", 1.0)))
        text = self.tok.decode([t for t in ids if t != END_ID])
        choice = {"index": 0, "finish_reason": finish}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        out = {"model": "fake-model", "object": "chat.completion" if chat else "text_completion", "choices": [choice]}
        if self.ids == "vllm":
            choice["token_ids"] = ids
        elif self.ids == "llama":
            out["__verbose"] = {"tokens": ids, "content": text}
        elif self.ids == "logprobs":
            choice["logprobs"] = {"content": [{"id": t, "logprob": 0.0} for t in ids]}
        return out

    def _handler(self):
        srv = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:  # quiet
                pass

            def _send(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with srv.lock:
                    srv.requests.append(dict(body, _path=self.path))
                    index = len(srv.requests) - 1
                    first = index == 0
                    step = srv.plan.pop(0) if srv.plan else None
                    failing = srv.fail_after is not None and srv.answered >= srv.fail_after
                    srv.inflight += 1
                    srv.max_inflight = max(srv.max_inflight, srv.inflight)
                try:
                    if step == "drop":
                        self.close_connection = True
                        self.connection.shutdown(2)
                        return
                    if isinstance(step, tuple) and step[0] == "sleep":
                        time.sleep(step[1])
                    if isinstance(step, int):
                        return self._send(step, {"error": {"message": f"planned {step}"}})
                    if failing:
                        return self._send(500, {"error": {"message": "server gone"}})
                    if srv.barrier is not None and index < srv.barrier.parties:
                        try:
                            srv.barrier.wait()
                        except threading.BrokenBarrierError:
                            return self._send(500, {"error": {"message": "requests did not arrive together"}})
                    if first and srv.delay_first_s:
                        time.sleep(srv.delay_first_s)
                    out = srv.reply(body, self.path)
                    with srv.lock:
                        srv.answered += 1
                    self._send(200, out)
                finally:
                    with srv.lock:
                        srv.inflight -= 1

        return H
