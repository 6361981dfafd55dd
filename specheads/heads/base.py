"""Common base for draft heads: what a head folder records (`HeadConfig`; the recipe section `HeadSpec` is
heads/headspec.py's), the module base (`DraftHead`: binds the frozen target parts by reference, saves/loads
safetensors), and what every kind shares;
what differs between kinds is each kind's KindSpec (heads/kinds.py), looked up here, never named.

A head folder is `config.json` (HeadConfig as JSON) + `model.safetensors` (the head's own weights only: the target's
embedding / lm_head / final norm are bound by reference at load time, never saved, never in `parameters()`).

Draft vocabulary (d2t / t2d). In memory and in the native folder, `d2t` is [V'] long holding the ABSOLUTE target id of
each draft id (`d2t[i]` = target id), sorted ascending, and `t2d` is [V] bool (True where the target id is in the draft
vocab). The EAGLE-3 repo, SGLang and speculators store `d2t` as OFFSETS (target id = i + d2t[i]; SGLang's
llama_eagle3.py: "d2t stores diffs between draft id and target id"); heads/export/common.py converts at the border.
Use `head.to_target_ids(ids)` rather than indexing by hand.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from specheads.heads.kinds import kind_names, kind_spec, kinds, kinds_where
from specheads.heads.headspec import HeadSpec
from specheads.heads.locate import WEIGHTS_NAME, head_folder, read_safetensors, read_weights  # noqa: F401 (importers)
from specheads.utils import (SpecheadsError, atomic_dir, atomic_write_json, atomic_write_text, read_json,
                             read_text_bounded, sha256_file)

log = logging.getLogger(__name__)


def __getattr__(name: str):
    """HEAD_CLASSES, BLOCK_KINDS and HEAD_KINDS: views of the kind registry (heads/kinds.py), kept for importers."""
    if name == "HEAD_KINDS":
        return kind_names()
    if name == "BLOCK_KINDS":
        return kinds_where(family="block")
    if name == "HEAD_CLASSES":
        return {k: (s.head.__module__, s.head.__name__) for k, s in kinds().items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


FORMAT_VERSION = 1  # bump when config.json or the key layout of model.safetensors changes
CONFIG_NAME = "config.json"  # WEIGHTS_NAME, "model.safetensors": heads/locate.py (also reads sharded heads)
CHECKSUM_NAME = "model.safetensors.sha256"  # `sha256sum -c` format; checked on load when present


def default_feature_layers(kind: str, num_layers_of_target: int) -> list[int]:
    """Indices into HF's hidden_states tuple (0 = embeddings, L = final post-norm state): the kind's default
    (KindSpec.feature_layers)."""
    return kind_spec(kind).feature_layers(int(num_layers_of_target))


def final_layer(L: int) -> list[int]:
    """The final post-norm state only: heads that read h_L (Medusa, EAGLE)."""
    return [int(L)]


def fused_layers(L: int) -> list[int]:
    """Three fused layers (EAGLE-3 and the heads built like it): three distinct ascending ids in 1..L-1, the only
    ones every serving engine captures (they capture the input of a decoder layer, residual included, so neither
    the embeddings 0 nor our post-norm L; docs/exports.md). From L = 7 on this is [2, L // 2, L - 3], the EAGLE-3
    repo's hardcoded layers, vLLM / SGLang's and speculators' default ([2, 15, 27] for SmolLM2); below that
    [2, L // 2, L - 3] repeats or reverses ids ([2, 2, 1] at L = 4), so 4 <= L <= 6 spreads [1, L // 2, L - 1]
    instead. L < 4 has no three such ids."""
    L = int(L)
    if L >= 7:
        return [2, L // 2, L - 3]
    if L >= 4:
        return [1, L // 2, L - 1]
    raise SpecheadsError(f"head.feature_layers: EAGLE-3 fuses 3 distinct target layers in 1..L-1 and this "
                         f"target has L = {L}; give head.feature_layers explicitly")


@dataclass
class HeadConfig:
    """What a head folder records: the spec plus the target it was built against."""

    kind: str
    target_name: str
    hidden_size: int  # D
    vocab_size: int  # V (target)
    feature_layers: list[int]  # resolved F ids (hidden_states tuple indices)
    fingerprint: dict  # target.fingerprint(): shapes + hash of a few rows of embedding and lm_head
    draft_vocab_size: int | None  # V' or None (= V)
    spec: dict  # the HeadSpec fields
    target_config: dict  # the target's text config (to_dict()): rebuilds the decoder layer and export configs
    format_version: int = FORMAT_VERSION
    # target.record(): family, every tensor's sampled hash, the GGUF source (specheads/target_record.py); None in
    # folders written before it existed (those are checked by `fingerprint` alone)
    target_record: dict | None = None

    @property
    def head_spec(self) -> HeadSpec:
        return HeadSpec(**self.spec)

    @property
    def out_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def from_target(cls, spec: HeadSpec, target) -> "HeadConfig":
        layers = list(spec.feature_layers) if spec.feature_layers else default_feature_layers(spec.kind, target.num_layers)
        for i in layers:
            if not 0 <= i <= target.num_layers:
                raise SpecheadsError(f"head.feature_layers: {i} is outside 0..{target.num_layers} for {target.name}")
        ks = kind_spec(spec.kind)
        if ks.final_state_only and layers != [target.num_layers]:
            raise SpecheadsError(f"head.feature_layers: {spec.kind} reads the final state only ([{target.num_layers}])")
        dv = spec.draft_vocab_size
        if dv is not None and dv > target.vocab_size:
            raise SpecheadsError(f"head.draft_vocab_size: {dv} exceeds the target vocab {target.vocab_size}")
        if dv == target.vocab_size:
            dv = None
        d = spec.to_section()
        d["feature_layers"] = layers
        d["draft_vocab_size"] = dv
        K = spec.options.block_size if ks.block_positions else 0
        if ks.block_positions and target.max_positions is not None and K + 1 >= target.max_positions:
            raise SpecheadsError(f"{spec.key('block_size')}: {K} does not fit the {target.max_positions} "
                                 f"positions of {target.name}")
        if ks.mask_token:
            d["mask_token_id"] = _mask_token(spec, target)
        return cls(kind=spec.kind, target_name=target.name, hidden_size=target.hidden_size,
                   vocab_size=target.vocab_size, feature_layers=layers, fingerprint=target.fingerprint(),
                   draft_vocab_size=dv, spec=d, target_config=target.text_config.to_dict(),
                   target_record=target.record())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "HeadConfig":
        if not isinstance(d, dict):
            raise SpecheadsError(f"{where}: expected a JSON object")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in d if k not in names]
        if unknown:
            raise SpecheadsError(f"{where}: unknown key {unknown[0]!r} (known: {names})")
        missing = [k for k in names if k not in d and k not in OPTIONAL_KEYS]
        if missing:
            raise SpecheadsError(f"{where}: missing key {missing[0]!r}")
        if d["format_version"] != FORMAT_VERSION:
            raise SpecheadsError(f"{where}: format_version {d['format_version']!r}, this build reads {FORMAT_VERSION}")
        if d["kind"] not in kind_names():
            raise SpecheadsError(f"{where}: key 'kind': {d['kind']!r} is not one of {list(kind_names())}")
        spec_keys = HeadSpec.section_keys(d["spec"]) if isinstance(d["spec"], dict) else {}
        bad = [k for k in d["spec"] if k not in spec_keys] if isinstance(d["spec"], dict) else ["spec"]
        if bad:
            raise SpecheadsError(f"{where}: unknown key 'spec.{bad[0]}'")
        spec = _check_config_values({**d, "spec": HeadSpec.drop_unread(d["spec"])}, where)
        return cls(**{**d, "spec": spec.to_section()})  # an old folder's flat spec read in today's form


OPTIONAL_KEYS = ("target_record",)  # keys a config.json may lack (written before they existed)


def _check_config_values(d: dict, where: str) -> HeadSpec:
    """Types and ranges of a config.json that do not need the target (check_target does the rest) -> its spec."""
    from specheads.config import _from_dict

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    wants = {"hidden_size": ("a positive integer", lambda v: is_int(v) and v >= 1),
             "vocab_size": ("a positive integer", lambda v: is_int(v) and v >= 1),
             "target_name": ("a string", lambda v: isinstance(v, str)),
             "fingerprint": ("a JSON object", lambda v: isinstance(v, dict)),
             "target_config": ("a JSON object", lambda v: isinstance(v, dict)),
             "feature_layers": ("a non-empty list of layer ids >= 0",
                                lambda v: isinstance(v, list) and v and all(is_int(i) and i >= 0 for i in v))}
    for key, (want, ok) in wants.items():
        if not ok(d[key]):
            raise SpecheadsError(f"{where}: key {key!r}: expected {want}, got {d[key]!r}")
    rec = d.get("target_record")
    if rec is not None and not (isinstance(rec, dict) and all(isinstance(rec.get(k), dict) for k in ("family",
                                                                                                   "weights"))):
        raise SpecheadsError(f"{where}: key 'target_record': expected null or a JSON object with 'family' and "
                             f"'weights' objects (target.record()), got {str(rec)[:80]}")
    dv = d["draft_vocab_size"]
    if dv is not None and (not is_int(dv) or not 1 <= dv < d["vocab_size"]):
        raise SpecheadsError(f"{where}: key 'draft_vocab_size': expected null or an integer in "
                             f"1..{d['vocab_size'] - 1} (below vocab_size), got {dv!r}")
    try:  # the spec through the recipe section's own type and range checks
        spec = _from_dict(HeadSpec, dict(d["spec"]), "head")  # its keys named as a recipe's head: section
    except SpecheadsError as e:
        raise SpecheadsError(f"{where}: key 'spec': {e}") from None
    for key in ("kind", "draft_vocab_size", "feature_layers"):
        if getattr(spec, key) != d[key]:
            raise SpecheadsError(f"{where}: key 'spec.{key}' is {getattr(spec, key)!r} but {key!r} is {d[key]!r}")
    return spec


def _mask_token(spec: HeadSpec, target) -> int:
    """The mask token id: explicit, else the tokenizer's mask, pad, eos or unk token (speculators'
    resolve_mask_token_id falls back the same way), 0 without a tokenizer; within the target vocab."""
    mid = spec.mask_token_id
    tok = getattr(target, "tokenizer", None)
    for name in ("mask_token_id", "pad_token_id", "eos_token_id", "unk_token_id"):
        if mid is None and tok is not None and getattr(tok, name, None) is not None:
            mid = int(getattr(tok, name))
    mid = 0 if mid is None else mid
    if not 0 <= mid < target.vocab_size:
        raise SpecheadsError(f"head.mask_token_id: {mid} is outside the target vocab 0..{target.vocab_size - 1}")
    return mid


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path), metadata=metadata)


class DraftHead(nn.Module):
    """Base of all heads. B batch, T sequence, N tree nodes, D hidden, V vocab, V' draft vocab.

    Frozen target modules live in `self._frozen` (a plain dict, so nn.Module neither registers them as submodules
    nor puts them in `state_dict()` / `parameters()` / `.to()`).
    """

    kind: ClassVar[str] = ""
    # the product the frozen target projection runs with (target_lm_logits); serving may set a faster one of the
    # same numbers' kind (infer/resolve.py: the bf16 kernel for a handful of rows)
    linear: Callable[..., torch.Tensor] = staticmethod(nn.functional.linear)

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self.spec = config.head_spec
        self._frozen: dict[str, nn.Module] = {}
        if config.draft_vocab_size:
            # Placeholder map (the first V' ids) until set_draft_vocab is called with measured counts.
            d2t = torch.arange(config.draft_vocab_size, dtype=torch.long)
            self.register_buffer("d2t", d2t)  # [V'] long, absolute target ids
            self.register_buffer("t2d", _t2d_from_d2t(d2t, config.vocab_size))  # [V] bool
        else:
            self.d2t = None
            self.t2d = None

    # ----- frozen target parts, shared by reference -----
    def bind(self, target) -> "DraftHead":
        """Share the target's embedding, lm_head and final norm by reference (not copied, not saved, not trained)."""
        self._frozen = {"embed_tokens": target.embed_tokens, "lm_head": target.lm_head}
        try:
            self._frozen["final_norm"] = target.final_norm
        except SpecheadsError:
            pass
        return self

    def _get_frozen(self, name: str) -> nn.Module:
        try:
            return self._frozen[name]
        except KeyError:
            raise RuntimeError(f"{type(self).__name__}: call bind(target) before use ({name} missing)") from None

    @property
    def embed_tokens(self) -> nn.Module:
        return self._get_frozen("embed_tokens")

    @property
    def lm_head(self) -> nn.Module:  # overridden by heads with their own projection
        return self._get_frozen("lm_head")

    @property
    def final_norm(self) -> nn.Module:
        return self._get_frozen("final_norm")

    @property
    def head_dtype(self) -> torch.dtype:
        for p in self.parameters():
            return p.dtype
        return torch.float32

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Target embedding of ids [...] -> [..., D], in the head's dtype (no gradient reaches the target)."""
        return self.embed_tokens(ids).to(self.head_dtype)

    def target_lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Frozen target lm_head over the draft vocab: h [..., D] -> [..., V'] (V' = V without a draft vocab)."""
        w = self._get_frozen("lm_head").weight
        if self.d2t is not None:
            # Gathering V' rows costs a V'xD copy: keep it while the frozen weight (the object, not its address,
            # which a freed weight hands to the next one) and the map stay the same.
            key = (w._version, w.device, self.d2t.device, self.d2t._version)
            cached = self._frozen.get("lm_rows")
            if cached is None or cached[0] != key or cached[2]() is not w:
                cached = (key, w.detach()[self.d2t.to(w.device)], weakref.ref(w))
                self._frozen["lm_rows"] = cached  # plain dict entry: never a parameter, never saved
            w = cached[1]
        return self.linear(h.to(w.dtype), w)

    def init_from_target(self) -> None:
        """Initialise trainable parts from the bound target (e.g. a per-head lm_head copied from it). Default: none."""

    # ----- draft vocabulary -----
    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft ids [...] -> target ids [...] (identity without a draft vocab)."""
        return ids if self.d2t is None else self.d2t[ids]

    def set_draft_vocab(self, d2t: torch.Tensor) -> None:
        """Install a draft vocab ([V'] absolute target ids, e.g. from `build_draft_vocab`) in a FRESH head (projections
        initialised from the target are re-initialised from the new rows)."""
        if self.d2t is None or d2t.shape != self.d2t.shape:
            raise SpecheadsError(f"draft vocab: expected {self.config.draft_vocab_size} ids, got {tuple(d2t.shape)}")
        d2t = d2t.to(torch.long)
        if not bool((d2t[1:] > d2t[:-1]).all()) or int(d2t.min()) < 0 or int(d2t.max()) >= self.config.vocab_size:
            raise SpecheadsError("draft vocab: d2t must be strictly increasing target ids within the target vocab")
        self.d2t.copy_(d2t)
        self.t2d.copy_(_t2d_from_d2t(d2t, self.config.vocab_size))
        if "lm_head" in self._frozen:  # fresh head: re-derive projections that copy target rows of the draft vocab
            self.init_from_target()

    # ----- save / load -----
    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write config.json + model.safetensors atomically (a half-written folder is never seen)."""
        out_dir = Path(out_dir)
        with atomic_dir(out_dir) as tmp:
            atomic_write_json(tmp / CONFIG_NAME, self.config.to_dict())
            write_safetensors(self.state_dict(), tmp / WEIGHTS_NAME, metadata={"format": "pt", "kind": self.kind})
            atomic_write_text(tmp / CHECKSUM_NAME, f"{sha256_file(tmp / WEIGHTS_NAME)}  {WEIGHTS_NAME}\n")
        return out_dir

    @classmethod
    def from_pretrained(cls, head_dir: str | Path, target, dtype: torch.dtype | None = None) -> "DraftHead":
        """Load a head folder (or a hub id: heads/locate.py) against `target` (checked: hidden size, vocab,
        fingerprint). dtype None = as saved. Its weights: model.safetensors, or the shards of an index."""
        head_dir = head_folder(head_dir)
        config = read_head_config(head_dir)
        check_target(config, target, str(head_dir))
        klass = head_class(config.kind)
        if cls is not DraftHead and not issubclass(klass, cls):
            raise SpecheadsError(f"{head_dir / CONFIG_NAME}: key 'kind' is {config.kind!r}, expected {cls.kind!r}")
        tensors, wpath = read_weights(head_dir)
        head = klass(config)
        load_state_checked(head, tensors, wpath)
        check_draft_vocab(tensors, config, wpath)
        check_checksum(head_dir)
        if dtype is None:
            dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
        return head.to(device=target.device, dtype=dtype).bind(target)


def _t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[d2t.cpu()] = True
    return t2d


def build_draft_vocab(token_counts, size: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The `size` most frequent tokens as a draft vocab (EAGLE-3 repo recipe: top-N by count, then sorted by id).

    token_counts: [V] counts (tensor or sequence), e.g. of assistant tokens in the training set.
    Returns (d2t [V'] long absolute target ids, ascending; t2d [V] bool; coverage = share of counted tokens covered).
    """
    counts = torch.as_tensor(token_counts, dtype=torch.float64).flatten()
    if not 1 <= size <= counts.numel():
        raise SpecheadsError(f"head.draft_vocab_size: {size} must be within 1..{counts.numel()}")
    top = torch.topk(counts, size, sorted=True).indices  # ties broken by topk; ids sorted next
    d2t = torch.sort(top).values.to(torch.long)
    total = float(counts.sum())
    coverage = float(counts[d2t].sum()) / total if total > 0 else 0.0
    return d2t, _t2d_from_d2t(d2t, counts.numel()), coverage


def read_head_config(head_dir: Path) -> HeadConfig:
    """config.json of a head folder or a hub id (heads/locate.py head_folder)."""
    path = head_folder(head_dir) / CONFIG_NAME
    return HeadConfig.from_dict(read_json(path), str(path))


def check_target(config: HeadConfig, target, where: str) -> None:
    """The head's recorded target against `target` (specheads/target_record.py): another family (hidden size,
    vocabulary, architecture, shapes) is one SpecheadsError naming both; the same family with other weights,
    another quantization or another tokenizer is one too unless `target.allow_other_target` (--allow-other-target),
    then one warning per head folder and target. A folder without a target_record is checked by its `fingerprint`
    (the embedding and lm_head) as before. Then the feature layers against the target's depth."""
    from specheads.target_record import FLAG, OTHER_FAMILY, OTHER_WEIGHTS, SAME, compare

    outcome, what = SAME, ""
    if config.hidden_size != target.hidden_size or config.vocab_size != target.vocab_size:
        outcome, what = OTHER_FAMILY, "; ".join(
            f"{k} {a} vs {b}" for k, a, b in (("hidden size", config.hidden_size, target.hidden_size),
                                             ("vocab", config.vocab_size, target.vocab_size)) if a != b)
    elif config.target_record is not None:
        outcome, what = compare(config.target_record, target.record())
    elif config.fingerprint != target.fingerprint():
        outcome, what = OTHER_WEIGHTS, ("embedding / lm_head fingerprint differs (a head folder from before the "
                                          "whole-target record: only those two were recorded)")
    if outcome != SAME:
        msg = (f"{where}: head was trained for target {config.target_name!r} but the target given is "
               f"{target.name!r}: {what}")
        if outcome == OTHER_FAMILY or not getattr(target, "allow_other_target", False):
            hint = "" if outcome == OTHER_FAMILY else f" (acceptance may collapse; {FLAG} uses it anyway)"
            raise SpecheadsError(msg + hint)
        warned = target.__dict__.setdefault("_warned_heads", set())
        if str(where) not in warned:
            warned.add(str(where))
            log.warning("%s; proceeding (%s): acceptance may be far below the head's own", msg, FLAG)
    L = target.num_layers
    cfg_file = Path(where) / CONFIG_NAME if Path(where).is_dir() else where
    outside = [i for i in config.feature_layers if not 0 <= i <= L]
    if outside:
        raise SpecheadsError(f"{cfg_file}: key 'feature_layers': {outside} outside 0..{L} ({target.name!r} has {L} "
                             f"layers; {L} = the final post-norm state)")
    if kind_spec(config.kind).final_state_only and config.feature_layers != [L]:
        raise SpecheadsError(f"{cfg_file}: key 'feature_layers': a {config.kind} head reads the final state only "
                             f"([{L}]), not {config.feature_layers}")


def check_draft_vocab(tensors: dict[str, torch.Tensor], config: HeadConfig, path: Path) -> None:
    """d2t holds strictly increasing target ids within the vocab, and t2d marks exactly them."""
    if not config.draft_vocab_size:
        return
    d2t, V = tensors["d2t"], config.vocab_size
    if d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise SpecheadsError(f"{path}: key 'd2t': expected integer target ids, got {d2t.dtype}")
    d2t = d2t.long()
    if int(d2t.min()) < 0 or int(d2t.max()) >= V or not bool((d2t[1:] > d2t[:-1]).all()):
        raise SpecheadsError(f"{path}: key 'd2t': expected strictly increasing target ids in 0..{V - 1}, found "
                             f"{int(d2t.min())}..{int(d2t.max())}")
    if not torch.equal(tensors["t2d"].bool(), _t2d_from_d2t(d2t, V)):
        raise SpecheadsError(f"{path}: keys 'd2t' and 't2d' disagree (t2d must mark exactly the ids in d2t)")


def check_checksum(head_dir: Path) -> None:
    """model.safetensors against the sha256 save_pretrained recorded beside it (folders without one, and sharded
    folders without a model.safetensors, which the sidecar cannot be about: unchecked)."""
    side = Path(head_dir) / CHECKSUM_NAME
    if not side.exists() or not (Path(head_dir) / WEIGHTS_NAME).is_file():
        return
    want = read_text_bounded(side, limit=1 << 12).split()[:1]  # one sha256 line
    if not want or len(want[0]) != 64:
        raise SpecheadsError(f"{side}: not a sha256 line ('<64 hex digits>  {WEIGHTS_NAME}')")
    got = sha256_file(Path(head_dir) / WEIGHTS_NAME)
    if got != want[0].lower():
        raise SpecheadsError(f"{Path(head_dir) / WEIGHTS_NAME}: sha256 {got[:16]}... differs from the "
                             f"{want[0][:16]}... recorded in {side.name} (the weights were changed or damaged after "
                             f"saving)")


def load_state_checked(head: nn.Module, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Strict load: a missing, unexpected or misshapen key is one SpecheadsError naming the file and key (the
    head's `defaulted_keys`, buffers added after folders were written, keep their initial values when missing)."""
    own = head.state_dict()
    for k in tensors:
        if k not in own:
            raise SpecheadsError(f"{path}: unexpected key {k!r}")
    tensors = {**{k: own[k] for k in getattr(head, "defaulted_keys", ()) if k in own}, **tensors}
    for k, v in own.items():
        if k not in tensors:
            raise SpecheadsError(f"{path}: missing key {k!r}")
        if tuple(tensors[k].shape) != tuple(v.shape):
            raise SpecheadsError(f"{path}: key {k!r} has shape {tuple(tensors[k].shape)}, expected {tuple(v.shape)}")
    head.load_state_dict(tensors, strict=True)


def head_class(kind: str) -> type[DraftHead]:
    """The DraftHead subclass of `kind` (its registered KindSpec.head)."""
    return kind_spec(kind).head


def build_head(spec: HeadSpec, target, token_counts=None, dtype: torch.dtype = torch.float32) -> DraftHead:
    """A fresh head for `target`, bound to it, on its device. dtype float32 by default (master weights for training).

    token_counts ([V], optional): counts used to pick the draft vocab when spec.draft_vocab_size is set; without
    them the draft vocab is a placeholder (the first V' ids) to be replaced by `head.set_draft_vocab`.
    """
    config = HeadConfig.from_target(spec, target)
    try:
        head = head_class(spec.kind)(config)
    except (MemoryError, RuntimeError) as e:  # a width typed 100x too large: torch's allocator refuses it at once
        if not isinstance(e, MemoryError) and "can't allocate memory" not in str(e):
            raise
        asked = re.search(r"allocate (\d+) bytes", str(e))
        said = f"one tensor of {int(asked.group(1)) / 2 ** 30:,.1f} GiB" if asked else type(e).__name__
        raise SpecheadsError(f"head.{spec.kind}: {kind_spec(spec.kind).label} of these sizes does not fit in memory "
                             f"({said} refused); lower its sizes (head.num_layers, head.{spec.kind}.*)") from None
    if config.draft_vocab_size:
        if token_counts is not None:
            d2t, _, coverage = build_draft_vocab(token_counts, config.draft_vocab_size)
            head.set_draft_vocab(d2t)
            log.info("draft vocab: %d tokens cover %.2f%% of the counted tokens", config.draft_vocab_size, 100 * coverage)
        else:
            log.warning("draft vocab of %d tokens without token counts: placeholder ids 0..%d",
                        config.draft_vocab_size, config.draft_vocab_size - 1)
    head = head.to(device=target.device, dtype=dtype).bind(target)
    head.init_from_target()
    return head


def load_head(head_dir: str | Path, target, dtype: torch.dtype | None = None) -> DraftHead:
    """Load any head folder (native format), dispatching on config.kind."""
    return DraftHead.from_pretrained(head_dir, target, dtype=dtype)


def causal_mask_4d(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Right-padded [B,T] 0/1 mask -> [B,1,T,T] float (0 attend, -inf not). Every row keeps its own diagonal so that
    padded rows never attend to nothing (sdpa would give NaN there)."""
    B, T = attention_mask.shape
    dev = attention_mask.device
    causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    allowed = causal[None] & attention_mask.bool()[:, None, :]  # [B,T,T]
    allowed = allowed | torch.eye(T, dtype=torch.bool, device=dev)[None]
    out = torch.zeros(B, 1, T, T, dtype=dtype, device=dev)
    return out.masked_fill(~allowed[:, None], torch.finfo(dtype).min)


def last_row(h: torch.Tensor) -> torch.Tensor:
    """h [B,T,D] -> [B,1,D] holding row T-1, as a fresh dense tensor. A slice h[:, -1:] keeps the batch stride
    T*D, and torch 2.13's CPU bf16 linear takes a path ~15x slower on such an input (measured: 220 ms instead of
    14 ms for SmolLM2's lm_head); index_select copies D values and avoids it."""
    return h.index_select(1, torch.tensor([h.shape[1] - 1], device=h.device))
