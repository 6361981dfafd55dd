"""Benchmark prompts: MT-bench (FastChat question.jsonl), HumanEval (plain completions), ShareGPT first turns
(`sharegpt:START`) or a JSONL file.

A `BenchPrompt` holds the user turns; `encode_turn` turns the conversation so far into token ids (chat template
for chat prompts, plain text for completions). Multi-turn MT-bench conditions turn 2 on the *method's own* turn-1
answer, as FastChat's `gen_model_answer.py` does, so each method sees its own history.
"""
from __future__ import annotations

import gzip
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specheads.conversations.load import load_conversations
from specheads.utils import SpecheadsError, bounded_lines

log = logging.getLogger(__name__)

MT_BENCH_CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]


@dataclass
class BenchPrompt:
    id: str
    category: str
    turns: list[str]  # user turns; only the first is used unless both turns were asked for
    chat: bool = True  # True: chat template; False: the text is a plain completion prefix
    meta: dict[str, Any] = field(default_factory=dict)


def _interleave_by_category(prompts: list[BenchPrompt]) -> list[BenchPrompt]:
    """Round-robin over categories (first of each, then second of each, ...), so `--limit 8` covers all 8
    MT-bench categories instead of the first 8 writing questions."""
    by_cat: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    out: list[BenchPrompt] = []
    i = 0
    while len(out) < len(prompts):
        for cat in by_cat:
            if i < len(by_cat[cat]):
                out.append(by_cat[cat][i])
        i += 1
    return out


def load_mt_bench(path: str | Path | None = None, both_turns: bool = False) -> list[BenchPrompt]:
    from specheads.assets import mtbench_questions

    path = Path(path) if path else mtbench_questions()
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        q = json.loads(line)
        turns = list(q["turns"]) if both_turns else list(q["turns"][:1])
        out.append(BenchPrompt(id=str(q.get("question_id", i)), category=q.get("category", "all"), turns=turns, chat=True))
    return out


def load_humaneval(path: str | Path | None = None) -> list[BenchPrompt]:
    from specheads.assets import humaneval_gz

    path = Path(path) if path else humaneval_gz()
    opener = gzip.open if str(path).endswith(".gz") else open
    out = []
    with opener(path, "rt") as f:
        for line in f:
            if line.strip():
                p = json.loads(line)
                out.append(BenchPrompt(id=p["task_id"], category="humaneval", turns=[p["prompt"]], chat=False,
                                       meta={"entry_point": p.get("entry_point")}))
    return out


def load_jsonl_prompts(path: str | Path, both_turns: bool = False) -> list[BenchPrompt]:
    """One JSON object per line with "prompt" (str: a plain completion) or "turns" (list of str: chat turns);
    optional "category" and "id" / "question_id". A "chat": true|false field overrides the default."""
    path = Path(path)
    if not path.exists():
        raise SpecheadsError(f"--dataset {path}: file not found (expected mt-bench, humaneval, sharegpt:START or a "
                             "JSONL file)")
    if path.is_dir():
        raise SpecheadsError(f"--dataset {path}: is a folder; expected a JSONL file (one prompt per line)")
    out = []
    with open(path, encoding="utf-8") as f:  # line by line, each bounded: an endless line is refused, not read on
        lines = [(n, line) for n, line in bounded_lines(f, path)]
    for n, line in lines:
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecheadsError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise SpecheadsError(f"{path}:{n}: expected a JSON object with a \"prompt\" or \"turns\" field")
        if isinstance(obj.get("turns"), list) and obj["turns"] and all(isinstance(t, str) for t in obj["turns"]):
            turns, chat = list(obj["turns"]), True
        elif isinstance(obj.get("prompt"), str):
            turns, chat = [obj["prompt"]], False
        else:
            raise SpecheadsError(f"{path}:{n}: needs a \"prompt\" string or a non-empty \"turns\" list of strings")
        chat = bool(obj.get("chat", chat))
        if not both_turns:
            turns = turns[:1]
        pid = str(obj.get("id", obj.get("question_id", n)))
        out.append(BenchPrompt(id=pid, category=str(obj.get("category", "all")), turns=turns, chat=chat))
    if not out:
        raise SpecheadsError(f"{path}: no prompts")
    return out


SHAREGPT_DEFAULT_LIMIT = 80  # sharegpt:START without --limit: as many prompts as MT-bench has


def load_sharegpt_prompts(start: int, limit: int) -> list[BenchPrompt]:
    """First user turns (20-1500 characters) of the packaged ShareGPT conversations start, start+1, ... as chat
    prompts. Recipes train on the first `data.max_conversations`, so a START past that gives unseen prompts of the
    training distribution."""
    convs, _ = load_conversations("sharegpt", start + 20 * limit)
    out = []
    for i in range(start, len(convs)):
        users = [m["content"] for m in convs[i]["messages"] if m["role"] == "user"]
        if users and 20 < len(users[0]) < 1500:
            out.append(BenchPrompt(id=str(i), category="sharegpt", turns=[users[0]], chat=True))
        if len(out) == limit:
            break
    if not out:
        raise SpecheadsError(f"--dataset sharegpt:{start}: no conversations from index {start} on")
    return out


# A request's kind, by the first matching rule (MT-bench's eight categories; a keyword heuristic, checked by hand on
# 40 ShareGPT first turns: it balances a dev set, it is not a classifier to report figures by).
_KIND_RULES = [
    ("coding", r"```|\b(code|python|javascript|typescript|java|c\+\+|sql|html|css|function|script|program|regex|"
               r"bug|compile|api|react|django|class|json)\b"),
    ("math", r"\b(calculate|solve|equation|integral|derivative|probability|math|percent(age)?|arithmetic|"
             r"how many|what is \d)|\d+\s*[-+*/^x]\s*\d+"),
    ("extraction", r"\b(extract|summari[sz]e|summary of|from the (following|text|passage|article|table)|list all|"
                   r"identify (the|all))\b"),
    ("roleplay", r"\b(act as|acting as|pretend|role-?play|imagine (you are|that you)|you are (a|an) )"),
    ("writing", r"\b(write|essay|story|poem|e-?mail|letter|blog|rewrite|paraphrase|draft|slogan|caption|tweet)\b"),
    ("reasoning", r"\b(riddle|puzzle|logic(al)?|reason(ing)?|deduce|which (one|is (better|more)))\b"),
    ("stem", r"\b(physics|chemistry|biology|science|scientific|engineering|quantum|energy|molecule|cell|dna|"
             r"climate|machine learning|neural|algorithm|electric\w*)\b"),
    ("humanities", r"\b(history|historical|philosoph\w*|econom\w*|politic\w*|culture|cultural|law|legal|society|"
                   r"psycholog\w*|religio\w*|art|literature|ethic\w*|marketing|business)\b"),
]
DEV_START = 12000  # sharegpt-dev draws from conversation 12,000 on: past every recipe's data.max_conversations


def request_kind(text: str) -> str | None:
    """The MT-bench category a request looks like (_KIND_RULES), or None."""
    import re

    low = text.lower()
    for kind, pattern in _KIND_RULES:
        if re.search(pattern, low):
            return kind
    return None


def load_sharegpt_dev(limit: int, exclude: set[str] | frozenset = frozenset(),
                      start: int = DEV_START) -> list[BenchPrompt]:
    """`sharegpt-dev`: ShareGPT first turns (20-1500 characters) from conversation `start` on, balanced over
    MT-bench's eight kinds of request (request_kind; round-robin, so `limit` 32 is 4 of each where the data has
    them), none whose conversation id is in `exclude` (the run's training conversations). Never benchmark prompts:
    the figures it predicts are measured on MT-bench."""
    per = -(-limit // len(MT_BENCH_CATEGORIES))
    by_kind: dict[str, list[BenchPrompt]] = {k: [] for k in MT_BENCH_CATEGORIES}
    convs, _ = load_conversations("sharegpt")
    for i in range(start, len(convs)):
        cid = convs[i]["conversation_id"]
        users = [m["content"] for m in convs[i]["messages"] if m["role"] == "user"]
        if cid in exclude or not users or not 20 < len(users[0]) < 1500:
            continue
        kind = request_kind(users[0])
        if kind is not None and len(by_kind[kind]) < per:
            by_kind[kind].append(BenchPrompt(id=cid, category=kind, turns=[users[0]], chat=True))
        if all(len(v) >= per for v in by_kind.values()):
            break
    out = _interleave_by_category([p for k in MT_BENCH_CATEGORIES for p in by_kind[k]])[:limit]
    if not out:
        raise SpecheadsError(f"sharegpt-dev: no ShareGPT conversations from index {start} on")
    short = [k for k, v in by_kind.items() if len(v) < per]
    if short:
        log.warning("sharegpt-dev: fewer than %d prompts of kind %s", per, ", ".join(short))
    return out


def load_prompts(dataset: str, limit: int | None = None, both_turns: bool = False) -> list[BenchPrompt]:
    """`dataset`: "mt-bench", "humaneval", "sharegpt:START", "sharegpt-dev" or a JSONL path. `limit` takes the first N after
    interleaving categories (MT-bench: one question per category first)."""
    if limit is not None and limit < 1:
        raise SpecheadsError(f"--limit {limit}: must be at least 1")
    if dataset in ("mt-bench", "mt_bench", "mtbench"):
        prompts = _interleave_by_category(load_mt_bench(both_turns=both_turns))
    elif dataset in ("humaneval", "human-eval"):
        prompts = load_humaneval()
    elif dataset == "sharegpt-dev":
        prompts = load_sharegpt_dev(limit or SHAREGPT_DEFAULT_LIMIT)
    elif dataset.startswith("sharegpt:"):
        start = dataset.split(":", 1)[1]
        if not start.isdigit():
            raise SpecheadsError(f"--dataset {dataset}: expected sharegpt:START with START a conversation index, "
                                 "e.g. sharegpt:2000")
        prompts = load_sharegpt_prompts(int(start), limit or SHAREGPT_DEFAULT_LIMIT)
    else:
        prompts = _interleave_by_category(load_jsonl_prompts(dataset, both_turns=both_turns))
    return prompts if limit is None else prompts[:limit]


def first_turn_ids(target, prompts: list[BenchPrompt], dataset: str) -> list[list[int]]:
    """Every prompt's first turn encoded as bench encodes it, each checked against the target's context window by
    the rule generate and bench apply to a prompt (engine/generate.py: it needs room for one new token), before
    anything runs: a prompt that does not fit is one SpecheadsError naming the dataset and the prompt (bench and
    eval refuse the same prompts)."""
    window = target.max_positions
    out = []
    for p in prompts:
        ids = encode_turn(target.tokenizer, p, 0, [])
        if window and len(ids) >= window:
            raise SpecheadsError(f"--dataset {dataset}: prompt {p.id}: {len(ids)} tokens do not fit the context "
                                 f"window of {window} of target {target.name} (no room for a new token); shorten "
                                 f"it or leave it out")
        out.append(ids)
    return out


def check_later_turns(target, prompts: list[BenchPrompt], dataset: str, max_new_tokens: int) -> None:
    """--both-turns: every later turn must fit the context window after earlier answers of up to max_new_tokens
    tokens each (a turn's prompt holds them), with room for a new token; else one SpecheadsError naming the prompt
    and the --max-new-tokens that fits, before anything runs (not a failure hours into the run)."""
    window = target.max_positions
    if not window:
        return
    for p in prompts:
        for turn in range(1, len(p.turns)):
            need = len(encode_turn(target.tokenizer, p, turn, [""] * turn)) + turn * max_new_tokens
            if need >= window:
                fits = (window - 1 - (need - turn * max_new_tokens)) // turn
                hint = f"lower --max-new-tokens to {fits}" if fits >= 1 else "shorten the prompt"
                raise SpecheadsError(f"--both-turns: --dataset {dataset}: prompt {p.id} turn {turn + 1}: up to {need} "
                                     f"tokens after {turn} answer(s) of up to {max_new_tokens} tokens, over the "
                                     f"context window of {window} of target {target.name}; {hint} or leave out "
                                     f"--both-turns")


def encode_turn(tokenizer, prompt: BenchPrompt, turn: int, answers: list[str]) -> list[int]:
    """Token ids for user turn `turn` given this method's own earlier `answers` (one per earlier turn)."""
    if tokenizer is None:
        raise SpecheadsError("the target has no tokenizer: bench needs one to encode prompts")
    if not prompt.chat:
        text = prompt.turns[0] if turn == 0 else "".join(
            t + a for t, a in zip(prompt.turns[:turn], answers)) + prompt.turns[turn]
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if getattr(tokenizer, "chat_template", None) is None:
        raise SpecheadsError("the target's tokenizer has no chat template; use a JSONL file with \"prompt\" fields "
                             "(plain completions) or a chat model")
    messages = []
    for t in range(turn):
        messages += [{"role": "user", "content": prompt.turns[t]}, {"role": "assistant", "content": answers[t]}]
    messages.append({"role": "user", "content": prompt.turns[turn]})
    from specheads.target import chat_prompt_ids

    return chat_prompt_ids(tokenizer, messages)


CALIBRATION_PROMPTS = 4  # probe prompts, spread evenly over the benchmark (MT-bench: 4 of its 8 categories); one
# prompt gives ~22 steps, too few to tell depth-2 acceptance from noise


def calibration_prompts(prompts: list, n: int = CALIBRATION_PROMPTS) -> list:
    """`n` prompts spread evenly over `prompts` (the first always included) for the `--tree auto` probe and the
    layer-skip search."""
    if len(prompts) <= n:
        return list(prompts)
    return [prompts[i * len(prompts) // n] for i in range(n)]


def calibration_ids(tokenizer, prompts: list, n: int = CALIBRATION_PROMPTS) -> list[list[int]]:
    """The probe's prompt ids: first turns of `calibration_prompts` through the chat template."""
    return [encode_turn(tokenizer, p, 0, []) for p in calibration_prompts(prompts, n)]
