"""Set-up shared by several test modules (imported as `helpers`: tests/ is on the path, as for `test_generate`)."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from specheads.heads import build_head
from specheads.heads.base import HeadSpec
from specheads.heads.kinds import kind_spec
from specheads.infer.drafters import Drafter


class Recording(Drafter):
    """Wraps a drafter and records every tree it proposes (tokens, parents). clear_on_reset: each generation starts
    an empty log (False: the log gathers every generation the drafter serves, e.g. a sampling loop)."""

    def __init__(self, inner, log, clear_on_reset: bool = True):
        self.inner, self.log, self.feature_layers = inner, log, inner.feature_layers
        self.clear_on_reset = clear_on_reset

    def reset(self, prompt_ids, features):
        if self.clear_on_reset:
            self.log.clear()
        self.inner.reset(prompt_ids, features)

    def propose(self, ctx):
        tree = self.inner.propose(ctx)
        self.log.append((tree.tokens.tolist(), tree.parents.tolist()))
        return tree

    def observe(self, tree, accepted, features):
        self.inner.observe(tree, accepted, features)


def make_head(target, kind: str, seed: int = 3, scale: float = 0.1, **overrides):
    """The kind's example head (KindSpec.example, then `overrides` of its HeadSpec fields) on `target`, moved far
    from its initialisation by `scale` (so that every part matters; 0: as built); a draft vocabulary is the
    highest target ids."""
    spec = HeadSpec(kind=kind, **{**kind_spec(kind).example, **overrides})
    counts = torch.arange(target.vocab_size) if spec.draft_vocab_size else None
    return perturb(build_head(spec, target, token_counts=counts), scale, seed)


# heads a kind builds under another name: a DFlash head is DSpark's block without its Markov and confidence heads
VARIANTS = {"dflash": ("dspark", {"markov_rank": 0, "confidence_head": False})}


def variant_kind(name: str) -> str:
    """The registered kind a VARIANTS name is built as (the name itself for a kind)."""
    return VARIANTS.get(name, (name, None))[0]


def make_named_head(target, name: str, **kw):
    """make_head for a kind or a VARIANTS name (its kind's example options with the variant's on top)."""
    base, opts = VARIANTS.get(name, (name, None))
    extra = {base: {**kind_spec(base).example.get(base, {}), **opts}} if opts else {}
    return make_head(target, base, **extra, **kw)


def perturb(head, scale: float = 0.1, seed: int | None = 3, trainable_only: bool = False):
    """Moves the head's parameters (trainable_only: those that train; a frozen copy of the target's rows stays)
    by scale * N(0, 1), drawn after torch.manual_seed(seed) (None: from the generator as it stands), so that the
    head is far from its initialisation; -> the head."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad or not trainable_only:
                p.add_(scale * torch.randn_like(p))
    return head


def greedy_chain(head, features, ids, p: int = 9, split: int | None = None):
    """A block head's served greedy chain at anchor p (the data's token ids[0, p]) from a cache of the rows before
    p, fed at once or in two pieces at `split` -> (cache, logits [K,V'], confidence [K] or None, forced): `forced`
    is ids with the drafts (target ids) written after the anchor, so that the teacher-forced forward at anchor p
    reads the greedy chain (the block heads' "served block == training forward" check)."""
    cache = head.new_cache()
    if split is None:
        head.extend_context(cache, features[0, :p])
    else:
        head.extend_context(cache, features[0, :split])
        head.extend_context(cache, features[:, split:p])
    logits, conf = head.draft_block(cache, ids[0, p])
    forced = ids.clone()
    forced[0, p + 1:p + 1 + len(logits)] = head.to_target_ids(logits.argmax(-1))
    return cache, logits, conf, forced


def two_token_probs(target, prompt: list[int], sampling) -> torch.Tensor:
    """The target's exact distribution of the first two new tokens after `prompt` under `sampling`: [V*V],
    P(a) P(b | a) at a * V + b, from two full forwards."""
    from specheads.infer.verify import target_probs

    V = target.vocab_size
    with torch.no_grad():
        p1 = target_probs(target.model(torch.tensor([prompt])).logits[0, -1:], sampling)[0]
        p2 = target_probs(target.model(torch.tensor([prompt + [x] for x in range(V)])).logits[:, -1], sampling)
    return (p1[:, None] * p2).flatten()


def sampled_pairs(target, drafter, prompt: list[int], n: int, top_k: int = 4):
    """n speculative generations of two new tokens (temperature 1, top_k, seeds 0..n-1) -> (counts [V*V] of the
    pairs, as two_token_probs orders them; drafted: draft nodes verified beyond the roots, all runs together)."""
    from specheads.infer.generate import SpeculativeGenerator

    V = target.vocab_size
    gen = SpeculativeGenerator(target, drafter)
    counts, drafted = torch.zeros(V * V), 0
    for s in range(n):
        out = list(gen.stream(prompt, max_new_tokens=2, temperature=1.0, top_k=top_k, seed=s, ignore_eos=True))
        ids = [x for chunk in out for x in chunk]
        counts[ids[0] * V + ids[1]] += 1
        drafted += gen.result.stats.tree_nodes - gen.result.stats.target_forwards
    return counts, drafted


FIXTURES = Path(__file__).resolve().parent / "fixtures"


def run_fixture(python: Path, fixture: str, *args, timeout: int = 150) -> dict:
    """tests/fixtures/<fixture> run by another virtual environment's `python` (a consumer package's: speculators,
    SpecForge) on `args`, offline, in an environment of PATH, HOME and one intra-op thread only; asserts it exited 0
    (its stderr's tail the message) -> the JSON report on its last stdout line."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HOME": os.environ.get("HOME", tempfile.gettempdir()),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    r = subprocess.run([str(python), str(FIXTURES / fixture), *map(str, args)], capture_output=True, text=True,
                       env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def verifier_states(target, toks):
    """The target's forward on toks with its hidden states, and its PRE-norm last state (speculators rebuilds its
    verifier targets from it, through its own verifier_norm) -> (out, pre)."""
    pre = {}
    hook = target.final_norm.register_forward_hook(lambda m, i, o: pre.setdefault("x", i[0].detach()))
    with torch.no_grad():
        target.model(toks)  # (a separate call: with output_hidden_states transformers runs the norm its own way)
        hook.remove()
        out = target.model(toks, output_hidden_states=True)
    return out, pre["x"]


def assert_resume_is_exact(target, recipe_at, data, val, tmp_path, stop: int = 4) -> None:
    """Training straight through (tmp_path/a) and training stopped after `stop` steps then resumed (tmp_path/b,
    the fresh head of the resumed run drawn from another seed, so that only the checkpoint can make it equal)
    end with bit-identical head weights. recipe_at(out) -> the Recipe writing to `out` (saving at `stop`)."""
    from specheads.train.trainer import Trainer

    def run(out, stop=None, resume=False):
        recipe = recipe_at(out)
        torch.manual_seed(123 if resume else 0)
        head = build_head(recipe.head, target)
        Trainer(recipe, target, head, data, val).train(resume=resume, stop_after=stop)
        return head.state_dict()

    a = run(tmp_path / "a")
    run(tmp_path / "b", stop=stop)
    b = run(tmp_path / "b", resume=True)
    assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) == 0.0


def save_token_rows(rows, folder: Path) -> None:
    """Sample rows (input_ids, loss_mask tensors) saved as a prepared tokens dataset in `folder` (conversation ids
    c0, c1, ...), as `specheads prepare` writes it for run_training to read."""
    import datasets

    ds = datasets.Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in rows],
                                     "loss_mask": [r["loss_mask"].tolist() for r in rows],
                                     "conversation_id": [f"c{i}" for i in range(len(rows))]})
    ds.save_to_disk(str(folder))


def speculators_export(target, head, tmp_path: Path, T: int = 24) -> torch.Tensor:
    """The head saved (tmp_path/h) and exported for speculators (tmp_path/s) against the target saved as its
    verifier folder (tmp_path/verifier: speculators reads its config and weights) -> random tokens [1,T] to run
    both on."""
    from specheads.heads.export import export_head

    target.model.save_pretrained(tmp_path / "verifier")
    head.save_pretrained(tmp_path / "h")
    export_head(tmp_path / "h", "speculators", tmp_path / "s", verifier_name_or_path=str(tmp_path / "verifier"))
    return torch.randint(0, target.vocab_size, (1, T), generator=torch.Generator().manual_seed(7))
