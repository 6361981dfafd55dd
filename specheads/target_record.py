"""A head's record of the target it was trained on, and the comparison of that record with the target it is given.

The record (`target_record(target)`, written into every head's config.json as `target_record`) has three parts:
- "family": the model class, model type, hidden size, layers, vocabulary, a hash of every parameter's name and
  shape, and hashes of the tokenizer's vocabulary and of its chat template;
- "weights": per parameter tensor (by name, as `named_parameters()` gives them: a tied lm_head once) a short hash
  of its shape and of SAMPLES elements spread over it, each rounded to bfloat16 and hashed by its bits, so that a
  bf16 copy and an fp32 copy of the same weights agree (reading ~64 elements per tensor: milliseconds for any
  size). A change confined to elements no sample reads is not seen; a fine-tune or another quantization moves
  nearly every element and is;
- "gguf": for a target converted from a GGUF file, the file's name, size and its tensors' quantization types.

`compare(recorded, current)` -> (outcome, what differs): SAME (silent), OTHER_WEIGHTS (the same family with other
weights, another tokenizer or another quantization: refused unless --allow-other-target, then one warning) or
OTHER_FAMILY (shapes, vocabulary or architecture differ: always refused). heads/base.py check_target applies it.
"""
from __future__ import annotations

import hashlib
import json
import struct
from collections import Counter
from functools import lru_cache
from pathlib import Path

import torch

RECORD_VERSION = 1
SAMPLES = 64  # elements hashed per tensor
SAME, OTHER_WEIGHTS, OTHER_FAMILY = "same", "other weights", "other family"
FLAG = "--allow-other-target"
# the family fields whose difference means the head cannot run on the target at all (always refused)
SHAPE_FIELDS = ("architecture", "model_type", "hidden_size", "num_layers", "vocab_size", "shapes")


def _sha(data: bytes, n: int = 12) -> str:
    return hashlib.sha256(data).hexdigest()[:n]


def sample_positions(numel: int, samples: int = SAMPLES) -> torch.Tensor:
    """`samples` flat indices spread over 0..numel-1: one per equal segment, at an offset within it that varies
    from segment to segment (so that a [V, D] matrix is read at many columns, not one). Integer arithmetic only:
    the same positions on every machine and torch version."""
    k = min(samples, numel)
    seg = numel // k
    return torch.tensor([i * seg + (i * 7919) % max(seg, 1) for i in range(k)], dtype=torch.long)


def tensor_hash(w: torch.Tensor) -> str:
    """Hash of a tensor's shape and of its sampled elements rounded to bfloat16 (their 16 bits): fp32 and bf16
    copies of the same weights give the same hash."""
    flat = w.detach().reshape(-1)
    sample = flat[sample_positions(flat.numel()).to(flat.device)].cpu()
    bits = sample.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    return _sha(str(list(w.shape)).encode() + b"|" + bits, 10)


def weights_record(named) -> dict:
    """{"count": n, "tensors": {name: tensor_hash}} over (name, tensor) pairs."""
    tensors = {name: tensor_hash(w) for name, w in named}
    return {"count": len(tensors), "tensors": tensors}


def _tokenizer_hashes(tok) -> tuple[str | None, str | None]:
    if tok is None:
        return None, None
    try:
        vocab = sorted(tok.get_vocab().items())
    except (AttributeError, NotImplementedError, TypeError):
        vocab = None
    t = None if vocab is None else _sha(json.dumps(vocab, ensure_ascii=False).encode())
    template = getattr(tok, "chat_template", None)
    c = None if template is None else _sha(json.dumps(template, sort_keys=True).encode())
    return t, c


def family_record(target, tok: str | None, template: str | None) -> dict:
    """What must match for a head to run at all (SHAPE_FIELDS), and the tokenizer's hashes (`_tokenizer_hashes`)."""
    shapes = [[n, list(p.shape)] for n, p in target.model.named_parameters()]
    return {"architecture": type(target.model).__name__, "model_type": getattr(target.text_config, "model_type", None),
            "hidden_size": target.hidden_size, "num_layers": target.num_layers, "vocab_size": target.vocab_size,
            "shapes": _sha(json.dumps(shapes).encode()), "tokenizer": tok, "chat_template": template}


_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9


def _skip_value(f, vtype: int) -> None:
    """Read past one metadata value (GGUF spec: strings are u64 length + bytes, arrays u32 type + u64 count)."""
    if vtype == _STRING:
        f.seek(struct.unpack("<Q", f.read(8))[0], 1)
    elif vtype == _ARRAY:
        etype, count = struct.unpack("<IQ", f.read(12))
        if etype in _SCALAR:
            f.seek(_SCALAR[etype] * count, 1)
        else:
            for _ in range(count):
                _skip_value(f, etype)
    elif vtype in _SCALAR:
        f.seek(_SCALAR[vtype], 1)
    else:
        raise ValueError(f"unknown GGUF value type {vtype}")


@lru_cache(maxsize=16)
def _gguf_types(path: str, size: int, mtime: int) -> tuple[dict, str | None]:
    """({type: tensors}, the type most of the file's matrices have) of a GGUF file (read once per path, size and
    mtime). Only the header is read, past the metadata to the tensor infos: gguf's GGUFReader decodes every
    metadata value first (~20 s for SmolLM2's tokenizer arrays), this takes milliseconds."""
    from gguf import GGMLQuantizationType

    types, matrices = Counter(), Counter()
    with open(path, "rb") as f:
        magic, _version, n_tensors, n_kv = struct.unpack("<4sIQQ", f.read(24))
        if magic != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        for _ in range(n_kv):
            f.seek(struct.unpack("<Q", f.read(8))[0], 1)  # the key
            _skip_value(f, struct.unpack("<I", f.read(4))[0])
        for _ in range(n_tensors):
            f.seek(struct.unpack("<Q", f.read(8))[0], 1)  # the name
            n_dims = struct.unpack("<I", f.read(4))[0]
            dims = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
            ttype, _offset = struct.unpack("<IQ", f.read(12))
            name = GGMLQuantizationType(ttype).name if ttype in GGMLQuantizationType._value2member_map_ else str(ttype)
            types[name] += 1
            if sum(d > 1 for d in dims) > 1:
                matrices[name] += 1
    common = (matrices or types).most_common(1)
    return dict(sorted(types.items())), common[0][0] if common else None


def gguf_record(path: str | Path) -> dict:
    """{"file", "size" (bytes), "types" {type: tensors}, "type" (the type most of its matrices have: Q4_1, Q8_0,
    BF16, ...)} of a GGUF file."""
    p = Path(path)
    st = p.stat()
    try:
        types, main = _gguf_types(str(p.resolve()), st.st_size, int(st.st_mtime))
    except (struct.error, ValueError, OSError):  # a header this reader cannot walk: the file's name and size only
        types, main = {}, None
    return {"file": p.name, "size": st.st_size, "types": dict(types), "type": main}


def target_record(target) -> dict:
    """The record of `target` (module docstring). The tokenizer's hashes are kept on the target (hashing a large
    vocabulary costs ~50 ms); the weights are sampled afresh each call (a few ms), so an edited target is seen."""
    tok = target.tokenizer
    cached = target.__dict__.get("_tokenizer_hashes")
    if cached is None or cached[0] != id(tok):
        cached = (id(tok), _tokenizer_hashes(tok))
        target.__dict__["_tokenizer_hashes"] = cached
    source = getattr(target, "gguf", None)
    return {"version": RECORD_VERSION, "family": family_record(target, *cached[1]),
            "weights": weights_record(target.model.named_parameters()),
            "gguf": gguf_record(source) if source else None}


def _quant(g: dict | None) -> str:
    return f"{g.get('file')} ({g.get('type')} GGUF)" if g else "a safetensors / Hugging Face copy (no GGUF)"


def compare(recorded: dict, current: dict) -> tuple[str, str]:
    """(SAME | OTHER_WEIGHTS | OTHER_FAMILY, what differs in a few words)."""
    fam, now = recorded.get("family") or {}, current.get("family") or {}
    shape = [f"{k} {fam.get(k)!r} vs {now.get(k)!r}" for k in SHAPE_FIELDS if fam.get(k) != now.get(k)]
    if shape:
        if shape[-1].startswith("shapes"):
            shape[-1] = "parameter names or shapes differ"
        return OTHER_FAMILY, "; ".join(shape)
    parts = []
    g0, g1 = recorded.get("gguf"), current.get("gguf")
    w0, w1 = (recorded.get("weights") or {}).get("tensors") or {}, (current.get("weights") or {}).get("tensors") or {}
    differ = [n for n in w0 if n in w1 and w0[n] != w1[n]]
    # the source only when the weights differ: the converted folder of the very GGUF holds the same weights
    if differ and (g0 or g1) and (g0 or {}).get("type") != (g1 or {}).get("type"):
        parts.append(f"trained on {_quant(g0)}, given {_quant(g1)} of the same model family")
    if differ:
        decoder_only = all(".layers." in n or n.startswith("layers.") for n in differ)
        parts.append(f"{'decoder ' if decoder_only else ''}weights differ in {len(differ)} of {len(w0)} tensors "
                     f"(first: {differ[0]})")
    for key, what in (("tokenizer", "the tokenizer's vocabulary"), ("chat_template", "the chat template")):
        if fam.get(key) != now.get(key) and fam.get(key) is not None and now.get(key) is not None:
            parts.append(f"{what} differs")
    return (OTHER_WEIGHTS, "; ".join(parts)) if parts else (SAME, "")
