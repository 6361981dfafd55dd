"""Reliability sweep, round four (issue 52): heads named by hub id, offline, and sharded heads (heads/locate.py).

Each case runs with HF_HUB_OFFLINE=1 and HF_HUB_CACHE={tmp}/hub, a cache laid out as huggingface_hub lays it
(tests/hubcache.py: blobs, refs/main, snapshots/<commit>/ symlinks), so nothing is ever downloaded.

`cases(h)` returns rows in scripts/reliability_sweep.py's case format (area, name, argv, rc, expect, risk from
reliability_doc.RISKS, optional setup / check / run / during); `h` is the sweep's HELPERS namespace.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from tests.hubcache import hub_repo, shard  # the fixture cache the tests use (ROOT is on sys.path)

ORG = "specheads-sweep"


@contextlib.contextmanager
def offline(ctx):
    """HF_HUB_OFFLINE=1 and the case's own cache {tmp}/hub while the CLI runs; the environment restored after."""
    keys = ("HF_HUB_OFFLINE", "HF_HUB_CACHE")
    before = {k: os.environ.get(k) for k in keys}
    os.environ.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(ctx.tmp / "hub"))
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _cache(ctx) -> Path:
    (ctx.tmp / "hub").mkdir(exist_ok=True)
    return ctx.tmp / "hub"


def sharded_without_a_shard(h) -> Callable:
    """The fixture's head in two shards with an index as {ORG}/sharded, the second shard's blob gone from the cache
    (a cleaned or interrupted cache: its snapshot link dangles)."""
    def setup(ctx) -> None:
        head = h.head(ctx)
        names = shard(head)
        snap, _ = hub_repo(_cache(ctx), f"{ORG}/sharded", head)
        (snap / names[1]).resolve().unlink()
    return setup


def pickled_only(h) -> Callable:
    """{ORG}/pickled: the head's config.json and its weights only as pytorch_model.bin, a pickle that would create
    {tmp}/pwned if it were ever unpickled."""
    def setup(ctx) -> None:
        import torch

        class Payload:
            def __reduce__(self):
                return os.system, (f"touch {ctx.tmp / 'pwned'}",)

        head = h.head(ctx)
        torch.save({"state": Payload()}, ctx.tmp / "pytorch_model.bin")
        hub_repo(_cache(ctx), f"{ORG}/pickled", {"config.json": (head / "config.json").read_bytes(),
                                                 "pytorch_model.bin": (ctx.tmp / "pytorch_model.bin").read_bytes()})
        shutil.rmtree(head)
    return setup


def published_sharded(h) -> Callable:
    """{ORG}/eagle3-speculators: the fixture's head as our own speculators export (a published layout), in two
    shards with an index."""
    def setup(ctx) -> None:
        from specheads.heads.export import export_head
        from specheads.target import load_target

        head = h.head(ctx)
        export_head(head, "speculators", ctx.tmp / "sp", target=load_target(ctx.vars["target"]))
        shard(ctx.tmp / "sp")
        hub_repo(_cache(ctx), f"{ORG}/eagle3-speculators", ctx.tmp / "sp")
    return setup


def no_download(ctx) -> str:
    found = [p.name for p in (ctx.tmp / "hub").rglob("*") if p.is_file()] if (ctx.tmp / "hub").exists() else []
    assert not found, f"files appeared in the cache: {found[:3]}"
    assert os.environ.get("HF_HUB_CACHE") != str(ctx.tmp / "hub"), "the environment was not restored"
    return "nothing downloaded; the environment restored"


def same_weights(ctx) -> str:
    from specheads.heads.base import read_weights

    ours, _ = read_weights(ctx.path("head"))
    back, _ = read_weights(ctx.tmp / "n")
    assert ours.keys() == back.keys(), "other tensors"
    assert all(bool((ours[k] == back[k]).all()) for k in ours), "other weights"
    return f"all {len(ours)} tensors equal the head's"


def cases(h) -> list[dict[str, Any]]:
    gen = ["generate", "--target", "{target}", "--prompt", "hi", "--max-new-tokens", "2", "--tree", "2,2,4",
           "--head"]
    return [
        {"area": "hub", "risk": "unclear", "name": "--head an unknown hub id, offline",
         "setup": _cache, "during": offline, "argv": gen + [f"{ORG}/absent"], "rc": 2,
         "expect": f"the hub id '{ORG}/absent' is not in the hub cache", "check": no_download},
        {"area": "hub", "risk": "unclear", "name": "--head a sharded hub head missing a shard",
         "setup": sharded_without_a_shard(h), "during": offline, "argv": gen + [f"{ORG}/sharded"], "rc": 2,
         "expect": "names the shard 'model-00002-of-00002.safetensors', which is not in"},
        {"area": "hub", "risk": "unclear", "name": "--head a hub head of pickles only (pytorch_model.bin)",
         "setup": pickled_only(h), "during": offline, "argv": gen + [f"{ORG}/pickled"], "rc": 2,
         "expect": "only pickles (pytorch_model.bin)", "check": h.not_executed},
        {"area": "hub", "risk": "silent wrong result", "name": "export --import a sharded speculators head by hub id",
         "setup": published_sharded(h), "during": offline,
         "argv": ["export", "--import", f"{ORG}/eagle3-speculators", "--target", "{target}", "--out", "{tmp}/n"],
         "rc": 0, "expect": "imported", "check": same_weights},
    ]
