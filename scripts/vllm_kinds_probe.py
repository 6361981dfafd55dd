"""Which of our kinds with a `speculators` export vLLM's CPU build serves (issue 52 point 2): for each, a head as
the kind's example builds it (untrained; acceptance is not the question), vLLM started with its export as the
speculator (--enforce-eager), 16 greedy tokens of two prompts against vLLM's plain decoding; a kind it cannot serve
is recorded with vLLM's own message (the server log's last error lines).

    SPECHEADS_VLLM_VENV=/path/.venv-vllm python scripts/vllm_kinds_probe.py [--kinds dspark,dflash,dflash2,peagle]
                                                                           [--out docs/results/vllm-kinds]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ERROR = re.compile(r"Error|error:|Traceback|not supported|NotImplemented|Unsupported", re.I)


def _head(target, kind: str, folder: Path) -> Path:
    from tests.helpers import make_named_head
    make_named_head(target, kind, scale=0.0).save_pretrained(folder)
    return folder


def probe(kind: str, target, plain, work: Path) -> dict:
    from specheads.infer.bench import MethodOptions, build_methods, head_entries
    from specheads.target import chat_prompt_ids
    row: dict = {"kind": kind}
    try:
        folder = _head(target, kind, work / kind)
    except Exception as e:  # noqa: BLE001 - a probe records what failed
        return {**row, "served": False, "stage": "build head", "message": f"{type(e).__name__}: {e}"[:400]}
    options = MethodOptions(heads=head_entries([f"h={folder}"]), vllm_eager=True)
    t = time.perf_counter()
    try:
        methods, extra = build_methods(["vllm:h"], target, options)
    except Exception as e:  # noqa: BLE001
        return {**row, "served": False, "stage": "start", "message": f"{type(e).__name__}: {e}"[-600:]}
    spec = next(m for m in methods if m.name == "vllm:h")
    try:
        same = []
        for q in ("What is the capital of France?", "Write a haiku about the sea."):
            ids = chat_prompt_ids(target.tokenizer, [{"role": "user", "content": q}])
            same.append(spec.generate(ids, 16).output_ids == plain.generate(ids, 16).output_ids)
        log = spec.server.log_text()
        row.update(served=True, outputs_equal_plain=all(same), start_s=round(time.perf_counter() - t, 1),
                   method=(extra["methods_info"]["vllm:h"].get("speculative_config") or {}).get("method"),
                   weight_warnings=[ln[-200:] for ln in log.splitlines() if re.search(r"missing|unused|not loaded", ln, re.I)][:5])
    except Exception as e:  # noqa: BLE001
        log = spec.server.log_text()
        row.update(served=False, stage="generate", message=f"{type(e).__name__}: {e}"[-400:],
                   vllm_says=[ln[-300:] for ln in log.splitlines() if ERROR.search(ln)][-6:])
    finally:
        spec.server.stop()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="dspark,dflash,dflash2,peagle")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "vllm-kinds"))
    a = ap.parse_args(argv)
    from specheads.infer.bench import MethodOptions, build_methods
    from specheads.target import load_target
    from specheads.utils import atomic_write_json
    target = load_target("smollm2-135m", dtype="float32")
    work = Path(tempfile.mkdtemp(prefix="vllm-kinds-"))
    methods, _ = build_methods(["vllm"], target, MethodOptions(vllm_eager=True))
    plain = next(m for m in methods if m.name == "vllm")
    try:
        rows = [probe(k, target, plain, work) for k in a.kinds.split(",")]
    finally:
        plain.server.stop()
    out = {"command": "python scripts/vllm_kinds_probe.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows}
    atomic_write_json(Path(a.out) / "vllm_kinds.json", out)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
