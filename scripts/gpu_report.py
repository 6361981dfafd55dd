"""The results page of one device check (docs/gpu.md): every figure read from the JSON scripts/gpu_check.py wrote.

    python scripts/gpu_report.py docs/results/gpu-h200/gpu_check.json > docs/results/gpu-h200/README.md
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _exact_table(sec: dict) -> list[str]:
    fp32, bf16 = sec["exactness_fp32"]["drafters"], sec["identical_bf16"]["drafters"]
    rows = ["| drafter | fp32 eager | fp32 CUDA graphs | bf16 eager | bf16 CUDA graphs |", "|---|---:|---:|---:|---:|"]
    for name in (k for k in fp32 if not k.endswith("+graphs")):
        cells = [fp32.get(name), fp32.get(name + "+graphs"), bf16.get(name), bf16.get(name + "+graphs")]
        rows.append(f"| {name} | " + " | ".join("-" if c is None else c.get("error") or f"{c['identical']:.2f}"
                                               for c in cells) + " |")
    return rows


def _decode_table(sec: dict) -> list[str]:
    rows = ["| shape | HF generate | plain, eager | plain, CUDA graphs | lookup, eager | lookup, CUDA graphs | graphs "
            "vs eager (plain) | graphs vs HF generate (plain) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for shape in ("llama-1b", "llama-8b"):
        d = sec.get(f"decode_{shape}")
        if not d or not d.get("ok"):
            continue
        m, hf = d["methods"], d["hf_generate"]["tokens_per_s"]
        tps = {k: v["tokens_per_s"] for k, v in m.items()}
        rows.append(f"| {shape} | {hf:.1f} | {tps['plain/off']:.1f} | {tps['plain/on']:.1f} | "
                    f"{tps['prompt-lookup/off']:.1f} | {tps['prompt-lookup/on']:.1f} | "
                    f"{tps['plain/on'] / tps['plain/off']:.2f}x | {tps['plain/on'] / hf:.2f}x |")
    return rows


def _cost_table(sec: dict) -> list[str]:
    rows = ["| shape | path | " + " | ".join(f"t({n})" for n in (1, 2, 4, 8, 16, 32, 64, 128)) + " |",
            "|---|---|" + "---:|" * 8]
    for shape in ("llama-1b", "llama-8b"):
        v = sec.get(f"verify_cost_{shape}")
        if not v or not v.get("ok"):
            continue
        for label, curve in (("CUDA graphs (<= 64 nodes)", v["verify"]), ("eager", v.get("verify_eager"))):
            if curve:
                rows.append(f"| {shape} | {label} | " + " | ".join(f"{curve['seconds'][str(n)] * 1e3:.2f} ms"
                                                                   for n in (1, 2, 4, 8, 16, 32, 64, 128)) + " |")
    return rows


def render(rec: dict) -> str:
    sec, env = rec["sections"], rec["sections"]["environment"]
    kinds = sec.get("training_bf16", {}).get("kinds") or {}
    out = [f"# The device check on {env.get('gpu')} ({rec['total_s']:.0f} s)", "",
           "Produced by the command in docs/gpu.md (`scripts/gpu_check.py`, JSON `gpu_check.json` here), page by "
           "`python scripts/gpu_report.py docs/results/gpu-h200/gpu_check.json`. Random-weight models (no weights "
           "travel); "
           f"torch {env['torch']}, CUDA {env['cuda']}, transformers {env['transformers']}, Python {env['python']}.",
           f"Failed sections: {rec['summary']['failed_sections'] or 'none'}.", "",
           "## Greedy outputs equal to HF generate (share of prompts)", "",
           "A random 4-layer Llama (hidden 256, vocab 1024), 6 prompts x 48 tokens, each drafter through "
           "`build_drafter`, with the owned forward eager (`--compile off`) and through CUDA graphs (`--compile on`).",
           "", *_exact_table(sec), "",
           "## One request's decoding speed (tokens/s; 128-token prompt, 128 new tokens, bf16, random weights)", "",
           *_decode_table(sec), "",
           "Prompt lookup runs on a repetitive prompt; a random model's answer rarely repeats it, so its τ is ~1 here "
           "(the column measures the loop's overhead, not lookup's gain).", "",
           "## One verify forward over 1,024 cached tokens (fastest of 5; chain masks)", "", *_cost_table(sec), "",
           "## One training step per head kind (1B shape, 4 x 1,024 tokens, bf16 autocast)", "",
           "| kind | tokens/s | step | target features |", "|---|---:|---:|---:|",
           *[f"| {k} | {v['tokens_per_s']:,.0f} | {v['step_s'] * 1e3:.0f} ms | {v['target_s'] * 1e3:.0f} ms |"
             for k, v in kinds.items()], ""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render(json.loads(Path(sys.argv[1]).read_text())))
