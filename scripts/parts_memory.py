"""Peak resident memory (ru_maxrss) of loading the bundled target for training, whole vs parts only (issue 50.3).

    python scripts/parts_memory.py whole|parts     # one mode per process: ru_maxrss is a process's peak

Loads SmolLM2-135M in bfloat16 (load_target, or target_parts.load_target_parts), builds an EAGLE-3 head (draft
vocabulary 32768) and takes one AdamW step on it from a loss over a random batch of features (B 2, T 256): the
target's share of a training rank's memory, plus the head's params, grads and Adam states. Prints one JSON line."""
from __future__ import annotations

import json
import resource
import sys

import torch

from specheads.heads.base import HeadSpec, build_head
from specheads.target import load_target
from specheads.target_parts import load_target_parts

mode = sys.argv[1]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB: interpreter + torch + transformers
t = (load_target if mode == "whole" else load_target_parts)("smollm2-135m", "bfloat16")
after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
head = build_head(HeadSpec(kind="eagle3", draft_vocab_size=32768, feature_layers=[2, 15, 27]), t,
                  token_counts=torch.arange(t.vocab_size))
opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4)
h = torch.randn(2, 256, 3 * t.hidden_size)
loss = head.fc(h.to(head.fc.weight.dtype)).float().pow(2).mean() + sum(p.float().pow(2).sum() for p in
                                                                          head.parameters() if p.requires_grad)
loss.backward()
opt.step()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"mode": mode, "target_params_M": round(sum(p.numel() for p in t.model.parameters()) / 1e6, 1),
                  "imports_MiB": round(base / 1024), "after_load_MiB": round(after_load / 1024),
                  "load_MiB": round((after_load - base) / 1024), "peak_MiB": round(peak / 1024)}))
