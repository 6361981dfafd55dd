"""docs/reliability.md from the sweep's rows (scripts/reliability_sweep.py), and a rerun of some cases merged into
the rows recorded in docs/reliability.json."""
from __future__ import annotations

RISKS = ("data loss", "silent wrong result", "traceback", "unclear")  # what a case guards against
# The rules the rows check, each fixed once where every command meets it (issue 38's classes among them).
RULES = [
    "Rules the rows hold the code to:",
    "",
    "- One folder, two lock places (`<run>/.specheads.lock`, `<parent>/.<name>.specheads.lock`), and every writer "
    "honours both: prepare and train refuse a folder an export is replacing, and nothing replaces a folder that "
    "holds a live run lock in it or in any folder below it (`--force` or not; `utils.refuse_held`, checked again "
    "at `atomic_dir`'s rename). A symlinked output is written through, never replaced.",
    "- A checkpoint's format says what it carries: `specheads-checkpoint/3` always has `checksums.sha256`, and one "
    "without is refused; an older `/2` one still loads, its log line saying what is known.",
    "- `eval` refuses what `bench` refuses (a prompt longer than the target's context window), and a summary names "
    "only folders that exist.",
    "- A regeneration killed and rerun ends as one uninterrupted run, order included (the file in the source's "
    "order; each sampled answer from a stream of its own).",
    "- Every input the CLI reads gets one line naming it (overrides, targets, GGUF files, datasets, checkpoints), "
    "and reads are bounded (`utils.MAX_TEXT_BYTES` per file read whole or per row).",
    "- SIGTERM is handled as SIGINT: training saves the step it was in and says how to continue, the lock is "
    "released, one line, exit 128 + signal. Advice in a message is a command the folder then accepts.",
]


def merge_rows(recorded: list[dict], rows: list[dict], cases: list[dict]) -> list[dict]:
    """One row per case of `cases`, in their order: the row just run when there is one, else the recorded one
    (rows of cases that are gone are dropped). A case with neither is an error naming it."""
    new = {(r["area"], r["name"]): r for r in rows}
    old = {(r["area"], r["name"]): r for r in recorded}
    keys = [(c["area"], c["name"]) for c in cases]
    missing = [name for key in keys if key not in new and key not in old for name in key[1:]]
    if missing:
        raise SystemExit(f"no recorded row for {missing}: run them too (--only) or the whole sweep")
    return [new.get(key) or old[key] for key in keys]


def render_markdown(rows: list[dict]) -> str:
    head = ["# Reliability: bad inputs and the message each gets", "",
            "Produced by `python scripts/reliability_sweep.py` (the real CLI, in-process, in fresh folders on a tiny "
            "random Llama with SmolLM2's tokenizer; cases in the `CASES` tables of the script, of "
            "scripts/reliability_cases.py and of scripts/reliability_table3.py). Exit 2 = the user's mistake or "
            "the machine refusing a write (full "
            "disk, file too large, read-only, permission denied), printed as one line; no row may end in a "
            "traceback. `risk` is what the case guards against (data loss, a silent wrong result, a traceback, "
            "an unclear message); `expected` is the fragment the message must hold; `<tmp>` is the case's "
            "folder; `also` lists what was checked besides the message. Full disks are a file size limit "
            "(`ulimit -f`, SIGXFSZ ignored: EFBIG) or a write that fails as a full disk does (ENOSPC, EDQUOT); "
            "read-only and permission-denied folders refuse every write under them (the sweep runs as root, "
            "where chmod does not stop writes). Rows of area `kill` run the CLI in processes of their own (one "
            "thread), SIGKILL each at a point found by polling the file system (its disk never finishes the fsync "
            "there), run it again (train: --resume) and compare every output with an uninterrupted run's "
            "(scripts/reliability_kill.py). tests/test_reliability_sweep.py keeps this page and the cases in step; "
            "`python scripts/reliability_sweep.py --only WORD --update` reruns the cases whose area or name holds "
            "WORD and rewrites this page with the other rows as recorded.", "", *RULES, "",
            "| risk | cases | as expected | known failing (open) | not as expected |", "|---|---:|---:|---:|---:|"]
    for risk in RISKS:
        rs = [r for r in rows if r["risk"] == risk]
        head.append(f"| {risk} | {len(rs)} | {sum(r['ok'] for r in rs)} | "
                    f"{sum(not r['ok'] and bool(r['open']) for r in rs)} | "
                    f"{sum(not r['ok'] and not r['open'] for r in rs)} |")
    head += ["", "| # | area | risk | bad input | command | exit (expected) | expected | message | also |",
             "|---|---|---|---|---|---|---|---|---|"]
    body = []
    for i, r in enumerate(rows, 1):
        also = r["also"] + (f" OPEN: {r['open']}" if r["open"] and not r["ok"] else "")
        cells = [str(i), r["area"], r["risk"], r["name"], f"`{r['command']}`", f"{r['rc']} ({r['expected_rc']})",
                 r["expected"], r["message"], also.strip()]
        body.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    bad = [r["name"] for r in rows if not r["ok"] and not r["open"]]
    known = [r["name"] for r in rows if not r["ok"] and r["open"]]
    tail = ["", f"{len(rows)} cases, {len(rows) - len(bad) - len(known)} as expected"
            + (f"; known failing (open): {known}" if known else "") + (f"; NOT as expected: {bad}" if bad else "")
            + "."]
    return "\n".join(head + body + tail) + "\n"
