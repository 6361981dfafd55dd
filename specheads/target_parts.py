"""The target without its decoder layers: what offline training reads of it (embeddings, final norm, lm_head).

    load_target_parts("path/to/hf-folder", "bfloat16")      # -> PartsTarget, a Target whose model has no layers

Offline training reads the head's features from the shards; of the target it needs only the token embeddings (the
heads' input embedding), the final norm (heads that normalise their own states) and the lm_head (the teacher's
logits recomputed from h_L, the draft-vocabulary rows heads start from): 2 x V x D + D values, 0.21 of SmolLM2-135M's
parameters and 0.03 of Llama-3-70B's. The model is first built on torch's meta device (no memory: its module tree,
parameter names and shapes), then only those modules are materialised and their tensors read by name from the
safetensors files through safe_open: the decoder layers' bytes are never read, and a folder without them loads.

Whatever asks for the decoder (`target.base(...)`, `model.layers`, a forward) gets one SpecheadsError: DECODER_NEEDED.
`record()` (the record heads keep, target_record.py) is the full target's: the one `specheads prepare` wrote into
the features folder (FEATURES_RECORD, bound with `bind_record` after its embed / lm_head / norm hashes are checked
against the loaded tensors), else sampled from the files (64 elements of each tensor, target_record.SAMPLES).
Shapes: V vocab, D hidden.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from specheads.target import Target, _gguf_source, check_target_folder, resolve_dtype, resolve_target_path
from specheads.safetensors_index import SafetensorsIndex, check_decoder_present  # noqa: F401 - re-exported
from specheads.utils import SpecheadsError, atomic_write_json, read_text_bounded

log = logging.getLogger(__name__)

PARTS = ("embed", "norm", "lm_head")
DECODER_NEEDED = "this needs the target's decoder layers, which offline training does not load"
FEATURES_RECORD = "target.json"  # in the features folder: the full target's record and fingerprint (prepare)
NORM_NAMES = ("norm", "final_layernorm", "ln_f")


class _NoDecoder(nn.Module):
    """The decoder stack's stand-in: its embedding and final norm, no layers; a forward or `.layers` is refused."""

    def __init__(self, name: str, embed_tokens: nn.Module, norm: nn.Module | None, norm_attr: str):
        super().__init__()
        self._target_name = name
        self.embed_tokens = embed_tokens
        if norm is not None:
            setattr(self, norm_attr, norm)

    def __getattr__(self, attr: str):
        if attr in ("layers", "h", "blocks"):
            raise SpecheadsError(f"target {self.__dict__.get('_target_name')!r}: `{attr}`: {DECODER_NEEDED}")
        return super().__getattr__(attr)

    def forward(self, *args, **kwargs):
        raise SpecheadsError(f"target {self._target_name!r}: a forward of the decoder: {DECODER_NEEDED}")


class PartsModel(nn.Module):
    """The *ForCausalLM's stand-in: config, generation_config, get_input/output_embeddings, get_decoder."""

    def __init__(self, name: str, config, decoder: _NoDecoder, lm_head: nn.Module, generation_config=None):
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        self.model = decoder
        self.lm_head = lm_head
        self._target_name = name

    def get_decoder(self):
        return self.model

    @property
    def base_model(self):
        return self.model

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, *args, **kwargs):
        raise SpecheadsError(f"target {self._target_name!r}: a forward of the model: {DECODER_NEEDED}")


@dataclass
class PartsTarget(Target):
    """A Target loaded by `load_target_parts`: embeddings, final norm and lm_head only (module docstring)."""

    folder: str = ""  # the HF folder the parts were read from
    parts: tuple = PARTS
    full_shapes: list = field(default_factory=list)  # [[name, shape]] of every parameter of the full model
    architecture: str = ""  # the full model's class name (the record's family)
    bound_record: dict | None = None  # the full target's record (the features folder's FEATURES_RECORD)

    @property
    def base(self) -> nn.Module:
        return self.model.model

    def record(self) -> dict:
        if self.bound_record is not None:
            return self.bound_record
        return sampled_record(self)

    def bind_record(self, record: dict, where: str) -> None:
        """Use `record` (the full target's, read from `where`) once the loaded tensors' hashes agree with it."""
        from specheads.target_record import tensor_hash

        tensors = (record.get("weights") or {}).get("tensors") or {}
        for name, p in self.model.named_parameters():
            full = _full_name(self, name)
            if full in tensors and tensors[full] != tensor_hash(p):
                raise SpecheadsError(f"{where}: records another target ({full} differs from {self.folder}); run "
                                     f"`specheads prepare` again, or give the target those features came from")
        self.bound_record = record


def _full_name(target: PartsTarget, name: str) -> str:
    """A PartsModel parameter name -> the full model's (model.embed_tokens.weight, model.norm.weight, lm_head.weight
    for a Llama); the map is made at load time."""
    return target.__dict__.get("_names", {}).get(name, name)


def load_target_parts(name_or_path: str, dtype: str | torch.dtype = "float32", parts: Sequence[str] = PARTS,
                      trust_remote_code: bool = False, device: str | None = None) -> PartsTarget:
    """The target's `parts` (of PARTS) only, read by name from its safetensors files (module docstring); a folder or
    alias (a .gguf is converted to a folder first, as load_target does)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise SpecheadsError(f"target parts: {bad} not among {list(PARTS)}")
    folder = Path(resolve_target_path(name_or_path))
    if not folder.is_dir():
        raise SpecheadsError(f"target {name_or_path!r}: loading its parts alone needs a local folder (a hub id: "
                             f"download it first, e.g. `huggingface-cli download {name_or_path}`)")
    check_target_folder(folder, name_or_path, trust_remote_code)
    torch_dtype = resolve_dtype(dtype)
    try:
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, dtype=torch_dtype)
        tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise SpecheadsError(f"target {name_or_path!r}: cannot load ({str(e).splitlines()[0][:300]})") from None
    names = {id(m): n for n, m in meta.named_modules()}
    embed, lm_head = meta.get_input_embeddings(), meta.get_output_embeddings()
    norm, norm_attr = _final_norm(meta)
    wanted = {"embed": embed, "lm_head": lm_head, "norm": norm}
    files = SafetensorsIndex(folder)
    full_shapes = [[n, list(p.shape)] for n, p in meta.named_parameters()]
    tied = lm_head is not None and embed is not None and lm_head.weight is embed.weight
    loaded: dict[str, str] = {}
    for part in ("embed", "lm_head", "norm"):
        mod = wanted[part]
        if mod is None or (part == "lm_head" and tied):
            continue
        if part not in parts:
            raise SpecheadsError(f"target parts: {part} is needed (the training code reads it); keep it in parts")
        prefix = names[id(mod)]
        mod.to_empty(device="cpu")
        for pname, p in mod.named_parameters(recurse=True):
            full = f"{prefix}.{pname}"
            with torch.no_grad():
                p.copy_(files.tensor(full, name_or_path).to(torch_dtype))
            p.requires_grad_(False)
            loaded[f"{part}.{pname}"] = full
    if tied:  # materialising the embedding gave it a new weight: the lm_head shares it again
        lm_head.weight = embed.weight
    decoder = _NoDecoder(name_or_path, embed, norm, norm_attr)
    model = PartsModel(name_or_path, config, decoder, lm_head, _generation_config(folder))
    model.eval().requires_grad_(False)
    if device:
        model.to(device)
    own = {n: _map_name(n, loaded, norm_attr) for n, _ in model.named_parameters()}
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    target = PartsTarget(model=model, tokenizer=tok, name=name_or_path, folder=str(folder), parts=tuple(parts),
                         full_shapes=full_shapes, architecture=type(meta).__name__,
                         gguf=_gguf_source(name_or_path))
    target.__dict__["_names"] = own
    target.__dict__["_files"] = files
    log.info("target %s: embeddings, final norm and lm_head only (%.1fM of %.1fM parameters; no decoder layers)",
             name_or_path, sum(p.numel() for p in model.parameters()) / 1e6,
             sum(p.numel() for p in meta.parameters()) / 1e6)
    return target


def _map_name(name: str, loaded: dict, norm_attr: str) -> str:
    """PartsModel names (model.embed_tokens.weight, model.<norm>.weight, lm_head.weight) -> the full model's."""
    head, _, rest = name.partition(".")
    if head == "lm_head":
        return loaded.get(f"lm_head.{rest}", loaded.get(f"embed.{rest}", name))
    sub, _, pname = rest.partition(".")
    part = "embed" if sub == "embed_tokens" else "norm" if sub == norm_attr else None
    return loaded.get(f"{part}.{pname}", name) if part else name


def _final_norm(meta) -> tuple[nn.Module | None, str]:
    get = getattr(meta, "get_decoder", None)
    dec = get() if get is not None else meta.base_model
    for attr in NORM_NAMES:
        m = getattr(dec, attr, None)
        if isinstance(m, nn.Module):
            return m, attr
    return None, "norm"


def _generation_config(folder: Path):
    from transformers import GenerationConfig

    if not (folder / "generation_config.json").is_file():
        return None
    try:
        return GenerationConfig.from_pretrained(str(folder))
    except (OSError, ValueError):
        return None


def sampled_record(target: PartsTarget) -> dict:
    """The full target's record (target_record.target_record's fields) from the files: the family from the meta
    model's names and shapes, each tensor's hash from its 64 sampled elements read one by one. A folder lacking
    some tensor (decoder layers stripped) cannot give it: one SpecheadsError naming them."""
    from specheads.target_record import RECORD_VERSION, _sha, _tokenizer_hashes, gguf_record, sample_positions

    files: SafetensorsIndex = target.__dict__["_files"]
    absent = files.missing(n for n, _ in target.full_shapes)
    tied_head = [n for n in absent if n.startswith("lm_head")]  # tied: no lm_head tensor of its own
    absent = [n for n in absent if n not in tied_head]
    if absent:
        raise SpecheadsError(f"target {target.name!r}: {target.folder} lacks {len(absent)} of the model's tensors "
                             f"(first: {absent[0]}) and no features folder records this target "
                             f"({FEATURES_RECORD}): run `specheads prepare` with the full target first")
    tensors = {}
    for n, shape in target.full_shapes:
        numel = 1
        for d in shape:
            numel *= d
        s = files.samples(n, sample_positions(numel)).to(target.dtype)
        bits = s.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        tensors[n] = _sha(str(list(shape)).encode() + b"|" + bits, 10)
    tok, template = _tokenizer_hashes(target.tokenizer)
    fam = {"architecture": target.architecture, "model_type": getattr(target.text_config, "model_type", None),
           "hidden_size": target.hidden_size, "num_layers": target.num_layers, "vocab_size": target.vocab_size,
           "shapes": _sha(json.dumps(target.full_shapes).encode()), "tokenizer": tok, "chat_template": template}
    source = getattr(target, "gguf", None)
    return {"version": RECORD_VERSION, "family": fam, "weights": {"count": len(tensors), "tensors": tensors},
            "gguf": gguf_record(source) if source else None}


# ------------------------------------------------------------------------------- the features folder's record

def write_features_record(target, folder: Path) -> None:
    """`specheads prepare` (full target): the target's record and fingerprint into <features>/FEATURES_RECORD
    (atomically), so that training with the parts alone records the same target in its heads."""
    atomic_write_json(Path(folder) / FEATURES_RECORD, {"name": target.name, "record": target.record(),
                                                       "fingerprint": target.fingerprint()})


def read_features_record(folder: Path) -> dict | None:
    """The record in <features>/FEATURES_RECORD, None without one; a damaged file is one SpecheadsError."""
    p = Path(folder) / FEATURES_RECORD
    if not p.is_file():
        return None
    try:
        d = json.loads(read_text_bounded(p))
        return dict(d["record"])
    except (ValueError, KeyError, TypeError):
        raise SpecheadsError(f"{p}: damaged (no target record); run `specheads prepare` again") from None
