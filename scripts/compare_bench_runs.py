"""Two `specheads bench` runs of the same heads, prompts and settings by two versions of the code (a refactor's
behaviour check): single run (BEFORE/single, AFTER/single): every method's text, target forwards and new tokens
per prompt (outputs.jsonl) and τ per method; batched sweep (BEFORE/batch, AFTER/batch): τ, target / row forwards,
new tokens and `identical` per method and batch size, when both runs have one. Timings are not compared.
Usage: python scripts/compare_bench_runs.py BEFORE AFTER OUT.json"""
import json, sys
from pathlib import Path

a, b, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])


def single_rows(d):
    return {(r["method"], r["prompt_id"], r["turn"]): (r["text"], r["target_forwards"], r["new_tokens"])
            for r in map(json.loads, (d / "single" / "outputs.jsonl").read_text().splitlines())}


def single_tau(d):
    return {m: v["overall"]["tau"] for m, v in json.loads((d / "single" / "results.json").read_text())["methods"].items()}


def batch_rows(d):
    r = json.loads((d / "batch" / "results.json").read_text())["batch_sizes"]
    return {(B, m): {k: v[k] for k in ("tau", "target_forwards", "row_forwards", "new_tokens", "identical")}
            for B, ms in r.items() for m, v in ms.items()}


ra, rb = single_rows(a), single_rows(b)
ta, tb = single_tau(a), single_tau(b)
has_batch = (a / "batch").exists() and (b / "batch").exists()
ba, bb = (batch_rows(a), batch_rows(b)) if has_batch else ({}, {})
res = {"single": {"rows": len(ra), "identical_rows": sum(ra[k] == rb.get(k) for k in ra),
                  "rows_differing": [list(k) for k in ra if ra[k] != rb.get(k)],
                  "methods": len(ta), "tau_before": ta, "tau_after": tb,
                  "tau_differs": {m: [ta[m], tb.get(m)] for m in ta if ta[m] != tb.get(m)}},
       "batch": {"rows": len(ba), "identical": sum(ba[k] == bb.get(k) for k in ba),
                 "differs": {f"B={k[0]} {k[1]}": [ba[k], bb.get(k)] for k in ba if ba[k] != bb.get(k)}}}
out.write_text(json.dumps(res, indent=2) + "\n")
s, bt = res["single"], res["batch"]
print(f"single: {s['identical_rows']}/{s['rows']} (method, prompt) outputs and forwards identical; τ identical for "
      f"{s['methods'] - len(s['tau_differs'])}/{s['methods']} methods; differs: {s['tau_differs']}")
if has_batch:
    print(f"batch: {bt['identical']}/{bt['rows']} (B, method) rows identical; differs: {list(bt['differs'])}")
