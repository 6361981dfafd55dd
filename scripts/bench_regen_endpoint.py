"""Regeneration through llama-server (an OpenAI-compatible endpoint, train/regen_endpoint.py) beside our own
regeneration, in the same run: ShareGPT first turns, greedy, the bundled target.

    SPECHEADS_LLAMACPP=/work/main/.llamacpp OMP_NUM_THREADS=2 python scripts/bench_regen_endpoint.py \\
        --conversations 32 --new-tokens 128 --slots 4 --batch-size 32 --out docs/results/regen-endpoint

Our side: train/regenerate.regenerate on the HF target (float32: bf16 kernels need AVX-512) with the batched loop
(data.regen_batch_size rows). The server's: llama-server on 127.0.0.1 serving the target's GGUF (f32 by default, the
dtype of our side; --server-dtype bf16 for llama.cpp's bf16; converted by llama.cpp's pinned converter) with --parallel slots, driven by the same regenerate with data.regen_endpoint
(/v1/completions, our template's token ids as the prompt, concurrency = slots). Both write the resume file format;
regen_endpoint.json holds each side's tokens, seconds and tokens/s, how many answers agree token for token (different
engines and dtypes: near-ties may differ), and a check that every id list the server returned re-decodes to the
text it returned.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specheads.conversations.load import load_conversations  # noqa: E402
from specheads.heads.gguf import target_gguf  # noqa: E402
from specheads.infer.bench.llamacpp import LlamaServer, default_threads  # noqa: E402
from specheads.target import load_target  # noqa: E402
from specheads.train.regen_endpoint import EndpointSettings, post_with_retries, reply_answer  # noqa: E402
from specheads.train.regenerate import history_prompt_ids, regenerate, stop_ids  # noqa: E402
from specheads.utils import atomic_write_json  # noqa: E402


def _answers(path: Path) -> dict[str, list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["id"]: next(m["token_ids"] for m in r["messages"] if m["role"] == "assistant") for r in rows}


def _first_prompt(c: dict) -> list[dict]:
    return c["messages"][:next(i for i, m in enumerate(c["messages"]) if m["role"] == "assistant")]


def _first_turns(tok, n: int, max_prompt: int) -> list[dict]:
    """The first n ShareGPT conversations (file order) whose first prompt fits max_prompt tokens (a longer one
    would be skipped by both sides alike)."""
    convs, _ = load_conversations("sharegpt", 4 * n)
    fits = [c for c in convs if len(history_prompt_ids(tok, _first_prompt(c), [])) <= max_prompt][:n]
    return [{"conversation_id": c["conversation_id"], "messages": c["messages"]} for c in fits]


def _ids_match_text(server: LlamaServer, tok, convs, stops: set[int], n: int) -> dict:
    """Ask the server for n answers directly: its returned ids re-decoded equal its returned text."""
    s = EndpointSettings(url=server.url + "/v1", concurrency=1)
    same, convs = 0, list(convs)[:n]
    for c in convs:
        prompt = history_prompt_ids(tok, _first_prompt(c), [])
        reply = post_with_retries(s, s.url + "/completions", {"prompt": prompt, "max_tokens": 32, "temperature": 0.0,
                                                               "return_tokens": True, "verbose": True})
        text, ids, finish = reply_answer(reply, "completions")
        ids = ids[:-1] if finish == "stop" and ids and ids[-1] in stops else ids
        same += tok.decode(ids, skip_special_tokens=True) == text
    return {"checked": len(convs), "ids_decode_to_text": same}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--server-dtype", default="f32", choices=("f32", "bf16"),
                    help="the served GGUF's type (default f32: the same float32 weights our side decodes)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "regen-endpoint"))
    a = ap.parse_args(argv)
    out = Path(a.out)
    work = Path(tempfile.mkdtemp(prefix="regen-endpoint-"))  # fresh files: a resumed one would time nothing
    target = load_target("smollm2-135m", dtype="float32")
    tok, stops = target.tokenizer, set(stop_ids(target, target.tokenizer))
    convs = _first_turns(tok, a.conversations, a.max_length - a.new_tokens)
    common = dict(max_length=a.max_length, max_new_tokens=a.new_tokens, batch_size=a.batch_size, max_turns=1,
                  progress=False)
    warm = [dict(c, conversation_id=f"warm-{c['conversation_id']}") for c in convs[:2]]  # first calls: not timed
    regenerate(target, warm, work / "warm-ours.jsonl", **dict(common, max_new_tokens=8))
    ours = regenerate(target, convs, work / "ours.jsonl", **common)
    load_before = os.getloadavg()[0]
    gguf = target_gguf("smollm2-135m", a.server_dtype)
    with LlamaServer(gguf, parallel=a.slots, ctx_size=a.slots * a.max_length) as server:
        endpoint = EndpointSettings(url=server.url + "/v1", concurrency=a.slots)
        regenerate(target, warm, work / "warm-server.jsonl", **dict(common, max_new_tokens=8), endpoint=endpoint)
        t = time.perf_counter()
        served = regenerate(target, convs, work / "server.jsonl", **common,
                            endpoint=endpoint)
        served["wall_s"] = round(time.perf_counter() - t, 3)
        check = _ids_match_text(server, tok, convs, stops, 8)
        args = server.args[1:]
    mine, theirs = _answers(work / "ours.jsonl"), _answers(work / "server.jsonl")
    rows = [json.loads(line) for line in (work / "server.jsonl").read_text().splitlines()]
    result = {
        "what": f"{len(convs)} ShareGPT first turns (the first whose prompt fits {a.max_length - a.new_tokens} "
                f"tokens) x up to {a.new_tokens} new tokens, greedy, smollm2-135m",
        "command": "python scripts/bench_regen_endpoint.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "threads": default_threads(), "load_1min_before_server": round(load_before, 2),
                    "load_1min_after": round(os.getloadavg()[0], 2)},
        "ours": {"engine": f"specheads batched loop, {a.batch_size} rows, HF forward, float32", **ours},
        "llama_server": {"engine": f"llama-server {a.slots} slots, {gguf.name}", "args": args, **served},
        "server_token_ids": {"rows": len(rows), "from_server": sum(r["regenerated_by"]["token_ids"] == "server"
                                                                    for r in rows), **check},
        "answers_identical": sum(mine[k] == theirs.get(k) for k in mine),
        "answers_compared": len(mine),
    }
    if ours["tokens_per_s"]:
        result["server_over_ours"] = round(served["tokens_per_s"] / ours["tokens_per_s"], 2)
    atomic_write_json(out / "regen_endpoint.json", result)
    print(json.dumps(result, indent=2))
    print(f"answers in {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
