"""`specheads bench`: every method on the same prompts in one process, alternated prompt by prompt.

Figures (all computed by the pure functions `summarize` / `compare`, tested on hand-made runs):
- tokens/s = total new tokens / total wall time of the generate calls (prefill included) over the prompts;
- τ = total new tokens / total target forwards that emit tokens (bonus included), so plain decoding is exactly
  1.00: HF generate's prefill forward emits the first token and counts; our loop's prefill only fills the cache
  (the first token comes from the first tree forward) and does not; None ("n/a") when forwards cannot be counted;
- speedup = tokens/s of the method / tokens/s of vanilla over the same prompts (a ratio of totals, not a mean of
  per-prompt ratios, so long answers weigh more, as in Spec-Bench);
- acceptance-length histogram: how many target forwards emitted 1, 2, 3, ... tokens (its mean is τ);
- identical (greedy only): share of prompt turns whose output token ids equal vanilla's exactly.

Methods: `vanilla` = HF `model.generate`; `prompt-lookup` = HF `model.generate(prompt_lookup_num_tokens=...)` (the
peer users already have; target forwards counted with a forward pre-hook); `head` = ours (specheads.infer.generate
with the head's drafter; `head+lookup` = the same tree with a prompt-lookup chain merged in, greedy only);
`draft-model` = ours with a small draft model as drafter.
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import platform
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from specheads.infer.prompts import BenchPrompt, encode_turn
from specheads.utils import SpecheadsError, atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)

SCHEMA = "specheads.bench/1"
KNOWN_METHODS = ("vanilla", "prompt-lookup", "head", "draft-model", "plain", "prompt-lookup-ours")
# plain: our loop with no drafter (its gap to vanilla is our loop's overhead); prompt-lookup-ours: our loop with our
# PromptLookupDrafter (compare with HF's prompt-lookup)
PROMPT_LOOKUP_NUM_TOKENS = 10  # HF docs' example value for prompt_lookup_num_tokens (candidate tokens per step)
PROMPT_LOOKUP_MAX_NGRAM = 2  # HF default max_matching_ngram_size
LOOKUP_SUFFIX = "+lookup"  # head:LABEL+lookup = that head's tree with a prompt-lookup chain merged in
HEAD_LOOKUP_TOKENS = PROMPT_LOOKUP_NUM_TOKENS  # +lookup chain length by default: the same chain as HF prompt lookup
DEFINITIONS = {
    "tokens_per_s": "total new tokens / total wall time of the generate calls (prefill included)",
    "tau": "total new tokens / total target forwards that emit tokens (bonus included; HF's prefill emits the first "
           "token and counts, our prefill only fills the cache and does not); vanilla = 1.00",
    "speedup": "tokens_per_s(method) / tokens_per_s(vanilla) over the same prompts (ratio of totals)",
    "accept_hist": "number of target forwards that emitted k tokens (k = accepted draft tokens + 1 bonus)",
    "identical": "greedy runs only: share of prompt turns whose output token ids equal vanilla's",
}


# --------------------------------------------------------------------------------------------------- records
@dataclass
class RunRecord:
    """One method on one prompt turn."""

    method: str
    prompt_id: str
    category: str
    turn: int
    prompt_tokens: int
    new_tokens: int
    time_s: float
    target_forwards: int | None  # None = could not be counted
    step_tokens: list[int] | None  # tokens emitted by each target forward (sum = new_tokens); None = unknown
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    phase_times: dict[str, float] | None = None  # seconds per phase (ours only)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def accept_histogram(records: list[RunRecord]) -> dict[str, int] | None:
    """{"k": number of target forwards that emitted k tokens}; None if any record lacks per-forward counts."""
    if not records or any(r.step_tokens is None for r in records):
        return None
    c = Counter(k for r in records for k in r.step_tokens)  # type: ignore[union-attr]
    return {str(k): c[k] for k in sorted(c)}


def summarize(records: list[RunRecord]) -> dict[str, Any]:
    """Figures for one method over a set of records (see the module docstring for definitions)."""
    tokens = sum(r.new_tokens for r in records)
    time_s = sum(r.time_s for r in records)
    fw = None if any(r.target_forwards is None for r in records) else sum(r.target_forwards for r in records)  # type: ignore[misc]
    return {
        "turns": len(records),
        "new_tokens": tokens,
        "time_s": round(time_s, 6),
        "tokens_per_s": _ratio(tokens, time_s),
        "target_forwards": fw,
        "tau": _ratio(tokens, fw) if fw else None,
        "accept_hist": accept_histogram(records),
    }


def compare(method_records: list[RunRecord], vanilla_records: list[RunRecord] | None, greedy: bool) -> dict[str, Any]:
    """`summarize` plus speedup against vanilla and (greedy) the identical share, matched by (prompt, turn)."""
    s = summarize(method_records)
    s["speedup"] = None
    s["identical"] = None
    if vanilla_records:
        s["speedup"] = _ratio(s["tokens_per_s"], summarize(vanilla_records)["tokens_per_s"])
        if greedy:
            ref = {(r.prompt_id, r.turn): r.output_ids for r in vanilla_records}
            pairs = [(r.output_ids, ref[(r.prompt_id, r.turn)]) for r in method_records if (r.prompt_id, r.turn) in ref]
            s["identical"] = (sum(a == b for a, b in pairs) / len(pairs)) if pairs else None
    return s


def step_breakdown(records: list[RunRecord]) -> dict[str, Any] | None:
    """Seconds per phase summed over records (from our loop's stats), each phase's share of the decoding steps
    (prefill excluded), and the non-model share: everything but the target's and the drafter's phases."""
    recs = [r for r in records if r.phase_times]
    if not recs:
        return None
    total: Counter = Counter()
    for r in recs:
        total.update({k: float(v) for k, v in r.phase_times.items()})  # type: ignore[union-attr]
    steps = {k: v for k, v in total.items() if k not in NOT_STEP_PHASES}
    step_s = sum(steps.values())
    shares = {k: (v / step_s if step_s else None) for k, v in steps.items()}
    model_keys = [k for k in steps if k in MODEL_PHASES]
    model = sum(steps[k] for k in model_keys)
    forwards = sum(r.target_forwards or 0 for r in recs)
    return {"seconds": {k: round(v, 6) for k, v in total.items()}, "step_share": shares,
            "model_phases": model_keys, "non_model_share": (1 - model / step_s) if step_s else None,
            "ms_per_step": (1000 * step_s / forwards) if forwards else None}


# phases (specheads.infer.generate stats.timings) that are model forwards; the rest is our loop's own work
MODEL_PHASES = {"draft", "target"}
NOT_STEP_PHASES = {"prefill"}


# --------------------------------------------------------------------------------------------------- methods
class Method:
    name: str = "method"
    info: dict[str, Any]

    def generate(self, input_ids: list[int], max_new_tokens: int) -> RunRecord:  # pragma: no cover - interface
        raise NotImplementedError


def _sampling_kwargs(temperature: float) -> dict[str, Any]:
    if temperature <= 0:
        return {"do_sample": False}
    # plain temperature sampling: switch off the generation config's top-k / top-p defaults
    return {"do_sample": True, "temperature": float(temperature), "top_k": 0, "top_p": 1.0}


class HFGenerate(Method):
    """HF `model.generate` (vanilla or with HF's prompt lookup). Target forwards and the tokens each emitted are
    read with a forward pre-hook: the first position of each call tells how far the previous call advanced."""

    def __init__(self, name: str, target, temperature: float, **generate_kwargs):
        self.name = name
        self.target = target
        self.kwargs = {**_sampling_kwargs(temperature), **generate_kwargs}
        self.info = {"implementation": "transformers model.generate", **generate_kwargs}
        self._starts: list[int] = []

    def _hook(self, module, args, kwargs):
        pos = kwargs.get("position_ids")
        if pos is not None:
            self._starts.append(int(pos.reshape(-1)[0]))
            return
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self._starts.append(int(cache.get_seq_length()) if cache is not None else 0)

    def generate(self, input_ids: list[int], max_new_tokens: int) -> RunRecord:
        model = self.target.model
        tok = self.target.tokenizer
        ids = torch.tensor([input_ids], device=self.target.device)
        pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else (self.target.eos_token_ids or [0])[0]
        self._starts = []
        handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)
        try:
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     eos_token_id=self.target.eos_token_ids or None, pad_token_id=pad, **self.kwargs)
                dt = time.perf_counter() - t0
        finally:
            handle.remove()
        new = out[0, len(input_ids):].tolist()
        step_tokens = forward_token_counts(self._starts, len(input_ids), len(new))
        return RunRecord(method=self.name, prompt_id="", category="", turn=0, prompt_tokens=len(input_ids),
                         new_tokens=len(new), time_s=dt, target_forwards=len(self._starts) if self._starts else None,
                         step_tokens=step_tokens, output_ids=new,
                         text=tok.decode(new, skip_special_tokens=True) if tok is not None else "")


def forward_token_counts(starts: list[int], prompt_len: int, new_tokens: int) -> list[int] | None:
    """Tokens emitted by each target forward, from the first position of each call. After a call the sequence holds
    exactly one token not yet in the cache, so call i emitted starts[i+1] - starts[i] tokens (the first call:
    starts[1] + 1 - prompt_len; the last: prompt_len + new_tokens - 1 - starts[-1])."""
    if not starts:
        return None
    ends = [s + 1 for s in starts[1:]] + [prompt_len + new_tokens]
    prev = [prompt_len] + ends[:-1]
    counts = [e - p for e, p in zip(ends, prev)]
    if any(c < 0 for c in counts) or sum(counts) != new_tokens:
        return None
    return counts


class OursGenerate(Method):
    """Our speculative loop (specheads.infer.generate) with a drafter. Needs from the inference module:
    `generate(target, drafter, input_ids, max_new_tokens=, temperature=, ...) -> GenerationResult(ids, text, stats)`
    with stats new_tokens, target_forwards, accept_hist, and per-phase timings (docs/architecture.md)."""

    def __init__(self, name: str, target, drafter, temperature: float, info: dict[str, Any], **gen_kwargs):
        self.name = name
        self.target = target
        self.drafter = drafter
        self.temperature = temperature
        self.gen_kwargs = gen_kwargs
        self.info = info

    def generate(self, input_ids: list[int], max_new_tokens: int) -> RunRecord:
        from specheads.infer import generate as gen_mod

        ids = torch.tensor([input_ids], device=self.target.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            res = gen_mod.generate(self.target, self.drafter, ids, max_new_tokens=max_new_tokens,
                                   temperature=self.temperature, **self.gen_kwargs)
        dt = time.perf_counter() - t0
        return record_from_generation(self.name, res, len(input_ids), dt, self.target.tokenizer)


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def record_from_generation(name: str, res: Any, prompt_len: int, dt: float, tokenizer) -> RunRecord:
    """Adapt a GenerationResult (ids = new tokens or prompt + new; stats as a dict or object) into a RunRecord."""
    stats = _get(res, "stats", {}) or {}
    ids = _get(res, "ids")
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    n_new = _get(stats, "new_tokens")
    new = ids[-n_new:] if n_new else (ids[prompt_len:] if len(ids) > prompt_len else ids)
    if n_new == 0:
        new = []
    fw = _get(stats, "target_forwards")
    hist = _get(stats, "accept_hist")
    step_tokens = None
    if isinstance(hist, dict):
        step_tokens = [int(k) for k, v in sorted(hist.items(), key=lambda kv: int(kv[0])) for _ in range(int(v))]
    elif isinstance(hist, (list, tuple)) and all(isinstance(x, int) for x in hist):
        # specheads.infer.generate: accept_hist[n] = steps that emitted n tokens
        step_tokens = [k for k, v in enumerate(hist) for _ in range(int(v))]
    if step_tokens is not None and fw is not None and (len(step_tokens) != fw or sum(step_tokens) != len(new)):
        # prefill forward (one token) not in the histogram: add it so that mean(hist) == tau
        if len(step_tokens) == fw - 1 and sum(step_tokens) == len(new) - 1:
            step_tokens = [1] + step_tokens
        else:
            log.debug("%s: accept_hist does not add up (forwards %s, tokens %s); histogram kept as reported",
                      name, fw, len(new))
    phases = None
    timings = _get(stats, "timings")
    if isinstance(timings, dict) and timings:
        phases = {str(k): float(x) for k, x in timings.items() if isinstance(x, (int, float))}
        pre = _get(stats, "prefill_s")
        if pre is not None:
            phases["prefill"] = float(pre)
    text = _get(res, "text") or (tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else "")
    return RunRecord(method=name, prompt_id="", category="", turn=0, prompt_tokens=prompt_len, new_tokens=len(new),
                     time_s=dt, target_forwards=int(fw) if fw is not None else None, step_tokens=step_tokens,
                     output_ids=list(new), text=text, phase_times=phases)


# --------------------------------------------------------------------------------------------------- the run
@dataclass
class BenchSettings:
    target: str
    dataset: str
    dtype: str
    temperature: float = 0.0  # 0 = greedy (identical-to-vanilla check on)
    max_new_tokens: int = 256  # per turn, tokens; MT-bench answers are usually longer, 256 keeps CPU runs short
    limit: int | None = None
    both_turns: bool = False
    seed: int = 0
    warmup_tokens: int = 16  # tokens generated by each method on the first prompt before timing starts


def command_line(argv: list[str] | None = None) -> str:
    """The command as the user would type it (`specheads bench ...`, also when run as `python -m specheads`)."""
    argv = list(sys.argv if argv is None else argv)
    if argv and Path(argv[0]).name in ("specheads", "__main__.py", "cli.py"):
        argv[0] = "specheads"
    return " ".join(shlex.quote(a) for a in argv)


def environment() -> dict[str, Any]:
    import transformers

    import specheads

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"torch": torch.__version__, "transformers": transformers.__version__, "specheads": specheads.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "gpu": gpu}


def run_bench(prompts: list[BenchPrompt], methods: list[Method], settings: BenchSettings, tokenizer,
              out_dir: str | Path | None = None, extra: dict[str, Any] | None = None,
              progress: bool = True) -> dict[str, Any]:
    """Run every method on every prompt (methods alternated prompt by prompt, starting method rotated), after one
    untimed warm-up per method. Writes results.json after every prompt; Ctrl-C keeps finished prompts
    (results["complete"] = False). Returns the results dict."""
    from tqdm.auto import tqdm

    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise SpecheadsError(f"--methods: duplicate method in {names}")
    records: list[RunRecord] = []
    meta = {"command": command_line(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "environment": environment(), **(extra or {})}
    complete = False
    interrupted = False
    bar = None
    try:
        if prompts and settings.warmup_tokens > 0:
            warm = encode_turn(tokenizer, prompts[0], 0, [])
            for m in methods:
                m.generate(warm, settings.warmup_tokens)
        n_turns = sum(len(p.turns) for p in prompts)
        bar = tqdm(total=n_turns, desc="bench", unit="turn", disable=not progress)
        for i, p in enumerate(prompts):
            order = methods[i % len(methods):] + methods[:i % len(methods)]
            prompt_records: list[RunRecord] = []
            for m in order:
                answers: list[str] = []
                for turn in range(len(p.turns)):
                    ids = encode_turn(tokenizer, p, turn, answers)
                    torch.manual_seed(settings.seed + 1000 * i + turn)  # same seed for every method
                    r = m.generate(ids, settings.max_new_tokens)
                    r.prompt_id, r.category, r.turn = p.id, p.category, turn
                    prompt_records.append(r)
                    answers.append(r.text)
            records.extend(prompt_records)  # a prompt counts only when every method finished it
            bar.update(len(p.turns))
            if out_dir is not None:
                atomic_write_json(Path(out_dir) / "results.json", build_results(records, names, settings, meta, False))
        complete = True
    except KeyboardInterrupt:
        interrupted = True
        log.warning("interrupted: keeping the %d finished prompts", len({r.prompt_id for r in records}))
    finally:
        if bar is not None:
            bar.close()
    results = build_results(records, names, settings, meta, complete)
    results["interrupted"] = interrupted
    if out_dir is not None:
        write_outputs(results, records, out_dir)
    return results


def build_results(records: list[RunRecord], names: list[str], settings: BenchSettings, meta: dict[str, Any],
                  complete: bool) -> dict[str, Any]:
    greedy = settings.temperature <= 0
    van = [r for r in records if r.method == "vanilla"]
    cats = sorted({r.category for r in records}, key=lambda c: (c not in _CAT_ORDER, _CAT_ORDER.get(c, 0), c))
    methods_out: dict[str, Any] = {}
    for name in names:
        mine = [r for r in records if r.method == name]
        overall = compare(mine, van or None, greedy)
        per_cat = {c: compare([r for r in mine if r.category == c], [r for r in van if r.category == c] or None, greedy)
                   for c in cats}
        methods_out[name] = {"overall": overall, "categories": per_cat, "step_breakdown": step_breakdown(mine)}
        ref = [r for r in records if r.method == "llama.cpp"]  # the second reference: llama.cpp plain decoding
        if ref and name != "llama.cpp":
            methods_out[name]["vs_llama.cpp"] = compare(mine, ref, greedy)
    return {"schema": SCHEMA, **meta, "settings": asdict(settings), "complete": complete, "definitions": DEFINITIONS,
            "num_prompts": len({r.prompt_id for r in records}), "categories": cats, "methods": methods_out}


def _cat_order() -> dict[str, int]:
    from specheads.infer.prompts import MT_BENCH_CATEGORIES

    return {c: i for i, c in enumerate(MT_BENCH_CATEGORIES)}


_CAT_ORDER = _cat_order()


# --------------------------------------------------------------------------------------------------- outputs
def _fmt(x: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def markdown_table(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = [f"# specheads bench: {s['target']} on {s['dataset']}", "",
             f"{results['num_prompts']} prompts, dtype {s['dtype']}, temperature {s['temperature']}, "
             f"max {s['max_new_tokens']} new tokens per turn, {results['environment']['cpu'] or 'unknown CPU'}"
             f" ({results['environment']['torch_threads']} threads), {results['date']}."
             + ("" if results.get("complete") else " **Incomplete run (interrupted).**"), "",
             "| method | tokens/s | τ | speedup | identical | new tokens | target forwards |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, m in results["methods"].items():
        o = m["overall"]
        lines.append(f"| {name} | {_fmt(o['tokens_per_s'], '.1f')} | {_fmt(o['tau'])} | {_fmt(o['speedup'], '.2f', 'x')}"
                     f" | {_fmt(o['identical'], '.0%')} | {o['new_tokens']} | {_fmt(o['target_forwards'], 'd')} |")
    cats = results["categories"]
    if len(cats) > 1:
        names = list(results["methods"])
        lines += ["", "## Per category (speedup / τ)", "", "| category | " + " | ".join(names) + " |",
                  "|---|" + "---:|" * len(names)]
        for c in cats:
            cells = []
            for n in names:
                f = results["methods"][n]["categories"][c]
                cells.append(f"{_fmt(f['speedup'], '.2f', 'x')} / {_fmt(f['tau'])}")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    for name, m in results["methods"].items():
        b = m.get("step_breakdown")
        if b:
            lines += ["", f"## Step time breakdown: {name} ({_fmt(b['ms_per_step'], '.1f')} ms per step)", "",
                      "| phase | seconds | share of steps |", "|---|---:|---:|"]
            for k, v in sorted(b["seconds"].items(), key=lambda kv: -kv[1]):
                lines.append(f"| {k} | {v:.3f} | {_fmt(b['step_share'].get(k), '.1%')} |")
            lines.append(f"| **non-model share** (all but {' + '.join(b['model_phases'])}) | | "
                         f"{_fmt(b['non_model_share'], '.1%')} |")
    trees = results.get("trees") or ({"head": results["tree"]} if results.get("tree") else {})
    for name, tree in trees.items():
        title = "Tree" if len(trees) == 1 else f"Tree: {name}"
        lines += ["", f"## {title}", "", f"{tree.get('summary', '')}", "", f"Why: {tree.get('reason', '')}"]
    lines += ["", "Definitions: " + "; ".join(f"**{k}** = {v}" for k, v in results["definitions"].items()) + ".", ""]
    return "\n".join(lines)


def write_plots(results: dict[str, Any], out_dir: str | Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out_dir = Path(out_dir)
    written = []
    names = list(results["methods"])
    cats = results["categories"] + (["overall"] if len(results["categories"]) > 1 else [])
    if not cats:
        return written

    def fig_value(name: str, cat: str, key: str):
        m = results["methods"][name]
        f = m["overall"] if cat == "overall" or len(results["categories"]) == 1 else m["categories"][cat]
        return f[key]

    shown = [n for n in names if n != "vanilla"] or names  # vanilla is the dashed line at 1.0
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 0.9 * len(cats) + 3), 7.5), sharex=True)
    width = 0.8 / max(1, len(shown))
    x = np.arange(len(cats))
    for ax, key, title in ((axes[0], "speedup", "Speedup vs vanilla (ratio of tokens/s)"),
                           (axes[1], "tau", "τ: tokens per target forward (accepted + bonus)")):
        for j, n in enumerate(shown):
            vals = [fig_value(n, c, key) for c in cats]
            ys = [v if v is not None else 0 for v in vals]
            bars = ax.bar(x + (j - (len(shown) - 1) / 2) * width, ys, width, label=n)
            for b_, v in zip(bars, vals):
                ax.text(b_.get_x() + b_.get_width() / 2, (v or 0) + 0.01, "n/a" if v is None else f"{v:.2f}",
                        ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="grey", lw=1, ls="--", label="vanilla = 1.00")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.set_ylim(0, max([1.15] + [1.15 * (fig_value(n, c, key) or 0) for n in shown for c in cats]))
    axes[1].set_xticks(x)
    axes[1].set_xticklabels(cats, rotation=30, ha="right")
    axes[0].legend(fontsize=8, loc="upper left", ncol=len(shown) + 1)
    s = results["settings"]
    fig.suptitle(f"{s['target']} · {s['dataset']} · {s['dtype']} · T={s['temperature']} · {results['num_prompts']} "
                 f"prompts · {s['max_new_tokens']} new tokens", fontsize=10)
    fig.tight_layout()
    p = out_dir / "speedup_tau.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    written.append(p.name)

    hists = {n: results["methods"][n]["overall"]["accept_hist"] for n in names}
    hists = {n: h for n, h in hists.items() if h and (n != "vanilla" or len(hists) == 1)}
    if hists:
        kmax = max(int(k) for h in hists.values() for k in h)
        ks = np.arange(1, kmax + 1)
        fig, ax = plt.subplots(figsize=(max(6, 0.5 * kmax + 3), 3.8))
        width = 0.8 / len(hists)
        for j, (n, h) in enumerate(hists.items()):
            tot = sum(h.values())
            ys = [h.get(str(k), 0) / tot for k in ks]
            tau = results["methods"][n]["overall"]["tau"]
            bars = ax.bar(ks + (j - (len(hists) - 1) / 2) * width, ys, width, label=f"{n} (τ={_fmt(tau)})")
            for b_, k in zip(bars, ks):  # counts on top: small shares stay readable
                if h.get(str(k)):
                    ax.text(b_.get_x() + b_.get_width() / 2, b_.get_height() + 0.005, str(h[str(k)]),
                            ha="center", va="bottom", fontsize=6)
        ax.set_xticks(ks)
        ax.set_xlabel("tokens emitted per target forward (accepted + bonus)")
        ax.set_ylabel("share of target forwards")
        ax.set_title("Acceptance-length histogram")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        p = out_dir / "accept_hist.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        written.append(p.name)
    return written


def write_outputs(results: dict[str, Any], records: list[RunRecord], out_dir: str | Path) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        results["plots"] = write_plots(results, out_dir)
    except Exception as e:  # a plot must never lose the measurements
        log.warning("plots not written: %s", e)
        results["plots"] = []
    atomic_write_json(out_dir / "results.json", results)
    atomic_write_text(out_dir / "results.md", markdown_table(results))
    atomic_write_text(out_dir / "outputs.jsonl", "".join(
        json.dumps({"method": r.method, "prompt_id": r.prompt_id, "category": r.category, "turn": r.turn,
                    "new_tokens": r.new_tokens, "time_s": round(r.time_s, 4), "target_forwards": r.target_forwards,
                    "text": r.text}) + "\n" for r in records))


def hf_methods(target, temperature: float) -> dict[str, Callable[[], Method]]:
    return {
        "vanilla": lambda: HFGenerate("vanilla", target, temperature),
        "prompt-lookup": lambda: HFGenerate("prompt-lookup", target, temperature,
                                            prompt_lookup_num_tokens=PROMPT_LOOKUP_NUM_TOKENS,
                                            max_matching_ngram_size=PROMPT_LOOKUP_MAX_NGRAM),
    }


def split_lookup(name: str) -> tuple[str, bool]:
    """'head:eagle3+lookup' -> ('head:eagle3', True); names without the suffix -> (name, False)."""
    return (name[:-len(LOOKUP_SUFFIX)], True) if name.endswith(LOOKUP_SUFFIX) else (name, False)


def is_head_method(name: str) -> bool:
    """head, head:LABEL, and either with +lookup."""
    base, _ = split_lookup(name)
    return base == "head" or (base.startswith("head:") and len(base) > len("head:"))


def check_method_names(names: list[str]) -> None:
    """One clear error for unknown --methods names (checked before the target loads)."""
    from specheads.infer.llamacpp import is_llamacpp_method

    unknown = [n for n in names if n not in KNOWN_METHODS and not is_head_method(n) and not is_llamacpp_method(n)]
    if unknown:
        raise SpecheadsError(f"--methods: unknown method(s) {unknown}; choose from {list(KNOWN_METHODS)} "
                             f"or head:LABEL, with {LOOKUP_SUFFIX} after a head method to merge a prompt-lookup chain, "
                             "or llama.cpp, llama.cpp:LABEL, llama.cpp-ngram")


def build_methods(names: list[str], target, args, calib_ids: list[list[int]] | None = None
                  ) -> tuple[list[Method], dict[str, Any]]:
    """Methods in the order asked (vanilla always included, first), plus extra results fields: the tree chosen
    for `head` and why. `calib_ids`: prompt(s) for the head's acceptance probe (`--tree auto`)."""
    check_method_names(names)
    names = ["vanilla"] + [n for n in names if n != "vanilla"]  # speedup and identical are measured against it
    heads = head_entries(getattr(args, "head", None))
    lookup = getattr(args, "head_lookup", None)
    lookup = HEAD_LOOKUP_TOKENS if lookup is None else int(lookup)
    if lookup < 1:
        raise SpecheadsError(f"--head-lookup {lookup}: must be at least 1 (tokens of the prompt-lookup chain)")
    if args.temperature > 0 and any(split_lookup(n)[1] for n in names):
        raise SpecheadsError(f"--methods {','.join(names)}: {LOOKUP_SUFFIX} methods are greedy only "
                             "(use --temperature 0)")
    expanded: list[str] = []
    for n in names:  # `head` / `head+lookup` stand for every --head given
        base, merged = split_lookup(n)
        expanded += [h + LOOKUP_SUFFIX * merged for h in heads] if base == "head" and heads else [n]
    names = expanded
    factories = hf_methods(target, args.temperature)
    probes: dict[str, Any] = {}  # head folder -> (head, tree choice, tree record): one probe per head
    methods: list[Method] = []
    extra: dict[str, Any] = {"methods_info": {}}
    for n in names:
        if n in factories:
            m = factories[n]()
        elif n in ("plain", "prompt-lookup-ours"):
            from specheads.infer.drafters import NoDrafter, PromptLookupDrafter

            drafter = NoDrafter() if n == "plain" else PromptLookupDrafter(num_tokens=PROMPT_LOOKUP_NUM_TOKENS,
                                                                           max_ngram=PROMPT_LOOKUP_MAX_NGRAM)
            m = OursGenerate(n, target, drafter, args.temperature,
                             {"implementation": f"specheads.infer.generate + {type(drafter).__name__}"})
        elif is_head_method(n):
            base, merged = split_lookup(n)
            if base not in heads:
                raise SpecheadsError(f"--methods {n}: no such head; given: {list(heads) or 'none (use --head DIR)'}")
            m, tree = build_head_method(target, args, calib_ids or [], head_dir=heads[base], name=base,
                                        lookup=lookup if merged else 0, probes=probes)
            extra.setdefault("trees", {})[m.name] = tree
            extra.setdefault("tree", tree)  # the first head's tree (results.json schema 1)
        elif n.startswith("llama.cpp"):  # llama-server engines (infer/llamacpp.py)
            from specheads.infer.llamacpp import build_llamacpp_method

            m = build_llamacpp_method(n, target, args)
        else:
            m = build_draft_model_method(target, args)
        methods.append(m)
        extra["methods_info"][m.name] = m.info
    return methods, extra


EAGLE_PROBE = {"depth": 5, "top_k": 3, "total_tokens": 24}  # probe tree measuring acceptance per depth/rank (CPU-sized)
CALIBRATION_TOKENS = 32  # tokens generated per probe prompt (untimed): ~15-30 steps
CALIBRATION_PROMPTS = 4  # probe prompts, spread evenly over the benchmark (MT-bench: 4 of its 8 categories);
# one prompt gave ~22 steps, too few to tell depth-2 acceptance from noise


def calibration_prompts(prompts: list, n: int = CALIBRATION_PROMPTS) -> list:
    """`n` prompts spread evenly over `prompts` (the first always included) for the `--tree auto` probe."""
    if len(prompts) <= n:
        return list(prompts)
    return [prompts[i * len(prompts) // n] for i in range(n)]


def calibration_ids(tokenizer, prompts: list, n: int = CALIBRATION_PROMPTS) -> list[list[int]]:
    """The `--tree auto` probe's prompt ids: first turns of `calibration_prompts` through the chat template."""
    from specheads.infer.prompts import encode_turn

    return [encode_turn(tokenizer, p, 0, []) for p in calibration_prompts(prompts, n)]


def head_entries(spec) -> dict[str, str]:
    """--head values -> {method name: head folder}. One head is the method `head`; several are `head:LABEL`, with
    LABEL given as LABEL=DIR or else the folder's head kind (eagle3, medusa, ...)."""
    if not spec:
        return {}
    items = [spec] if isinstance(spec, str) else list(spec)
    if len(items) == 1 and "=" not in items[0]:
        return {"head": items[0]}
    out: dict[str, str] = {}
    for it in items:
        label, _, path = it.rpartition("=") if "=" in it else ("", "", it)
        if not label:
            label = _kind_from_folder(path)
        name = f"head:{label}"
        if name in out:
            raise SpecheadsError(f"--head {it}: label {label!r} used twice; name them as LABEL=DIR")
        out[name] = path
    return out


def _kind_from_folder(path: str) -> str:
    from specheads.heads.base import read_head_config

    try:
        return str(read_head_config(Path(path)).kind)
    except SpecheadsError as e:
        raise SpecheadsError(f"--head {path}: no readable head config ({e}); give it as LABEL=DIR") from None


def _head_kind(head) -> str:
    return "medusa" if head.config.kind == "medusa" else "eagle"


def build_head_method(target, args, calib_ids: list[list[int]], head_dir: str | None = None,
                      name: str = "head", lookup: int = 0, probes: dict | None = None) -> tuple[Method, dict[str, Any]]:
    """`head`: our loop with the head's drafter. `--tree auto`: measured verify cost (cached profile) + the head's
    acceptance on a probe run -> tree size and depth (specheads.infer.profile.choose_tree). `lookup` > 0: a
    prompt-lookup chain of up to that many tokens merged into the head's tree (method NAME+lookup; greedy only).
    `probes`: {head_dir: (head, choice, tree)} shared by one run's methods, so that a head's plain and +lookup
    methods load it and run the `--tree auto` probe once."""
    from specheads.heads.base import load_head
    from specheads.infer.drafters import EagleDrafter, MedusaDrafter
    from specheads.infer.tree import DEFAULT_MEDUSA_CHOICES, parse_choices

    head_dir = head_dir or getattr(args, "head", None)
    if not head_dir:
        raise SpecheadsError("--methods head: needs --head DIR (a head folder written by `specheads train`)")
    reuse = probes.get(str(head_dir)) if probes is not None else None  # this head's earlier method in the run
    head = reuse[0] if reuse else load_head(head_dir, target)
    head.eval()
    kind = _head_kind(head)
    spec = str(getattr(args, "tree", "auto") or "auto")
    info: dict[str, Any] = {"implementation": "specheads.infer.generate", "head": str(head_dir),
                            "head_kind": head.config.kind}
    tree: dict[str, Any] = {"mode": spec, "kind": kind}
    if spec == "auto":
        choice, tree = (reuse[1], dict(reuse[2])) if reuse else choose_tree_for_head(
            target, head, kind, calib_ids, refresh=getattr(args, "refresh_profile", False))
        if probes is not None:
            probes[str(head_dir)] = (head, choice, dict(tree))
        if kind == "medusa":
            drafter = MedusaDrafter(head, choices=choice.choices)
        else:
            drafter = EagleDrafter(head, depth=choice.depth, top_k=choice.top_k, total_tokens=choice.total_tokens)
    elif kind == "eagle" and spec.count(",") == 2:
        try:
            depth, top_k, total = (int(x) for x in spec.split(","))  # the order `specheads generate --tree` takes
        except ValueError:
            raise SpecheadsError(f"--tree {spec!r}: expected auto or DEPTH,TOP_K,TOTAL integers (as specheads generate)") from None
        drafter = EagleDrafter(head, depth=depth, top_k=top_k, total_tokens=total)
        tree.update(total_tokens=total, depth=depth, top_k=top_k, reason="given with --tree",
                    summary=f"EAGLE-2 dynamic tree, {total} nodes, depth {depth}, top-k {top_k} (given)")
    elif kind == "eagle":
        choices = parse_choices(spec)
        depth = max(len(c) for c in choices)
        top_k = max(max(c) for c in choices) + 1
        drafter = EagleDrafter(head, depth=depth, top_k=top_k, total_tokens=len(choices))
        tree.update(total_tokens=len(choices), depth=depth, top_k=top_k, reason="given with --tree",
                    summary=f"EAGLE-2 dynamic tree, {len(choices)} nodes, depth {depth}, top-k {top_k} (given)")
    else:
        choices = DEFAULT_MEDUSA_CHOICES if spec in ("default", "medusa") else parse_choices(spec)
        drafter = MedusaDrafter(head, choices=choices)
        tree.update(choices=[list(c) for c in choices], total_tokens=len(choices), reason="given with --tree",
                    summary=f"static Medusa tree, {len(choices)} nodes (given)")
    info["tree"] = {k: tree.get(k) for k in ("total_tokens", "depth", "top_k") if k in tree}
    if lookup > 0:  # greedy: prompt lookup's chain merged into the head's tree (drafters.LookupMergedDrafter)
        from specheads.infer.drafters import LookupMergedDrafter

        drafter = LookupMergedDrafter(drafter, num_tokens=lookup, max_ngram=PROMPT_LOOKUP_MAX_NGRAM)
        name += LOOKUP_SUFFIX
        info["lookup_tokens"] = lookup
        tree["summary"] = f"{tree.get('summary', '')} + a prompt-lookup chain of up to {lookup} tokens merged in"
    tree["method"] = name
    return OursGenerate(name, target, drafter, args.temperature, info), tree


def choose_tree_for_head(target, head, kind: str, calib_ids: list[list[int]], refresh: bool = False):
    """Profile (cached) + probe run -> (TreeChoice, tree record for results.json)."""
    from specheads.infer import generate as gen_mod
    from specheads.infer.drafters import EagleDrafter, MedusaDrafter
    from specheads.infer.profile import (PROBE_T1_TOLERANCE, RecordingDrafter, acceptance_matrix, choose_tree,
                                         interp_cost, load_or_profile, monotone_in_rank, relative_costs, t1_seconds)
    from specheads.infer.tree import DEFAULT_MEDUSA_CHOICES

    prof = load_or_profile(target, refresh=refresh)
    costs = relative_costs(prof)
    if kind == "medusa":
        probe_depth = int(getattr(head.config, "num_heads", 0) or 4)
        probe_rank = 4
        choices = [c for c in DEFAULT_MEDUSA_CHOICES if len(c) <= probe_depth]
        inner = MedusaDrafter(head, choices=choices)
        probe = {"choices": len(choices), "depth": probe_depth}
    else:
        probe_depth, probe_rank = EAGLE_PROBE["depth"], EAGLE_PROBE["top_k"]
        inner = EagleDrafter(head, **EAGLE_PROBE)
        probe = dict(EAGLE_PROBE)
    rec = RecordingDrafter(inner)
    t = time.perf_counter()
    per_prompt = []  # (target seconds per tree forward, mean tree nodes) of each probe prompt
    for ids in calib_ids:
        st = gen_mod.generate(target, rec, torch.tensor([ids], device=target.device), max_new_tokens=CALIBRATION_TOKENS,
                              temperature=0.0).stats
        per_prompt.append((st.timings["target"] / max(st.target_forwards, 1), st.tree_nodes / max(st.target_forwards, 1)))
    probe_s = time.perf_counter() - t
    acc, seen = acceptance_matrix(rec.steps, probe_depth, probe_rank)
    fitted = monotone_in_rank(acc, seen)  # a lower rank never beats a higher one (probe noise aside)
    # one-token forward time in this run: the probe's tree forwards divided by their size's relative cost. The
    # draft is priced against it (both timed side by side now), and a cached profile whose t1 is far from it was
    # measured in another state of the machine (another process sharing the cores): measure it again
    def probe_t1(c: dict[int, float]) -> float:  # median over the probe prompts (the first one also warms up)
        t1s = sorted(sec / interp_cost(c, n) for sec, n in per_prompt)
        return t1s[len(t1s) // 2]

    t1_now, remeasured = probe_t1(costs), False
    if prof["cached"] and not 1 / PROBE_T1_TOLERANCE <= t1_seconds(prof) / t1_now <= PROBE_T1_TOLERANCE:
        log.warning("the cached cost profile's one-token forward (%.1f ms) is far from this run's (%.1f ms): "
                    "measuring the profile again", 1e3 * t1_seconds(prof), 1e3 * t1_now)
        prof, remeasured = load_or_profile(target, refresh=True), True
        costs = relative_costs(prof)
        t1_now = probe_t1(costs)
    t1_from = "the probe's tree forwards / their relative cost"
    if not prof.get("noisy") and not 1 / PROBE_T1_TOLERANCE <= t1_seconds(prof) / t1_now <= PROBE_T1_TOLERANCE:
        # a clean profile measured in this state of the machine (fresh or just re-measured) still disagrees: the
        # probe's own forwards were slowed (seen: 142 vs 43 ms on a fresh machine, the probe being the run's first
        # tree work), so the profile's timed one-token forward prices the draft
        log.warning("the probe's one-token forward (%.1f ms) is far from the fresh profile's (%.1f ms): pricing the "
                    "draft against the profile's", 1e3 * t1_now, 1e3 * t1_seconds(prof))
        t1_from = f"the profile (the probe's tree forwards gave {1e3 * t1_now:.1f} ms)"
        t1_now = t1_seconds(prof)
    # draft cost = first depth + each further depth, from two shapes timed now: the probe's deep tree and a
    # depth-1 tree of the same width (short and untimed otherwise; its acceptance is not used)
    draft_per_step = rec.seconds_per_step()  # median drafter seconds per step (propose + observe), deep tree
    shallow = RecordingDrafter(MedusaDrafter(head, choices=[[r] for r in range(probe_rank)]) if kind == "medusa"
                               else EagleDrafter(head, depth=1, top_k=probe_rank, total_tokens=probe_rank))
    for ids in calib_ids[:2]:
        gen_mod.generate(target, shallow, torch.tensor([ids], device=target.device),
                         max_new_tokens=CALIBRATION_TOKENS // 2, temperature=0.0)
    first_s = shallow.seconds_per_step()
    further_s = max(0.0, (draft_per_step - first_s) / max(probe_depth - 1, 1))
    c1, c = first_s / t1_now, further_s / t1_now
    max_nodes = max(costs) - 1
    choice = choose_tree(fitted, costs, c, kind=kind, max_nodes=max_nodes, max_depth=probe_depth, draft_first=c1)
    summary = (f"{'EAGLE-2 dynamic tree' if kind == 'eagle' else 'static Medusa tree'}: {choice.total_tokens} draft "
               f"nodes, depth {choice.depth}, top-k {choice.top_k}; expected τ {choice.expected_tau:.2f}, "
               f"expected speedup {choice.expected_speedup:.2f}x")
    tree = {"mode": "auto", "kind": kind, "summary": summary, "reason": choice.reason, **choice.to_dict(),
            "rule": "maximise expected τ / (t(n+1)/t(1) + draft cost), Sequoia-style; acceptance measured on a "
                    "probe run of the head with a wide tree on a few prompts spread over the benchmark (untimed)",
            "acceptance": {"acc": acc, "acc_monotone": fitted, "counts": seen, "probe": probe,
                           "probe_steps": rec.num_steps, "probe_tokens": CALIBRATION_TOKENS * len(calib_ids),
                           "probe_s": round(probe_s, 3)},
            "draft_cost": {"seconds_per_step": draft_per_step, "depth1_seconds_per_step": first_s,
                           "relative_first": c1, "relative_per_unit": c, "unit": "per further depth",
                           "t1_s": t1_now, "t1_from": t1_from},
            "profile": {"path": prof["path"], "cached": prof["cached"], "verify_relative": prof["verify"]["relative"],
                        "t1_s": t1_seconds(prof), "context": prof["verify"]["context"],
                        "remeasured": remeasured, "noisy": prof.get("noisy", False),
                        "measured_at": prof.get("measured_at")}}
    log.info("tree: %s (%s)", summary, choice.reason)
    return choice, tree


def build_draft_model_method(target, args) -> Method:
    """`draft-model`: our loop with a small causal LM drafting a chain. --draft-model NAME (loaded like a target,
    same dtype; must share the vocabulary) or truncated:N (the target's first N layers, no training)."""
    from specheads.infer.drafters import DraftModelDrafter, truncated_draft_model
    from specheads.target import load_target

    spec = getattr(args, "draft_model", None)
    if not spec:
        raise SpecheadsError("--methods draft-model: needs --draft-model NAME (or truncated:N)")
    k = int(getattr(args, "draft_tokens", 4) or 4)
    if spec.startswith("truncated:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise SpecheadsError(f"--draft-model {spec!r}: expected truncated:N with N layers") from None
        model = truncated_draft_model(target, n)
    else:
        draft = load_target(spec, dtype=target.dtype, device=str(target.device))
        if draft.vocab_size != target.vocab_size:
            raise SpecheadsError(f"--draft-model {spec}: vocabulary {draft.vocab_size} differs from the target's "
                                 f"{target.vocab_size}")
        model = draft.model
    info = {"implementation": "specheads.infer.generate + DraftModelDrafter", "draft_model": spec, "draft_tokens": k}
    return OursGenerate("draft-model", target, DraftModelDrafter(model, num_tokens=k), args.temperature, info)
