"""GGUF export for llama.cpp: draft heads (EAGLE-3, DSpark / DFlash) and their target, converted by the
`convert_hf_to_gguf.py` of the llama.cpp source pinned by `scripts/setup_llamacpp.sh` (the vendor/llama.cpp of the
PyPI sdist llama-cpp-python==0.3.36), then read back and checked against the head.

    specheads export --head runs/x/final --format gguf --out runs/x/gguf [--target-gguf]
    -> runs/x/gguf/draft.gguf (+ target.gguf), gguf_export.json
    llama-server -m target.gguf -md draft.gguf --spec-type draft-eagle3 --spec-draft-n-max 3   (an eagle3 head:
    its DraftKind and checks are heads/eagle3_gguf.py)
    llama-server -m target.gguf -md draft.gguf --spec-type draft-dspark --spec-draft-n-max K'   (a dspark head)
    llama-server -m target.gguf -md draft.gguf --spec-type draft-dflash --spec-draft-n-max K'   (a dflash2 head:
    its DraftKind and checks are heads/dflash2_gguf.py)

The converter takes an HF-style draft folder plus `--target-model-dir` (tokenizer, vocab, target sizes). We write
that folder ourselves (the eagle3 layout of heads/export/eagle3.py, then the keys the converter reads set
explicitly), so that no convention is left to the converter's defaults. What the pinned source reads (file:line in
vendor/llama.cpp):
- detection: `draft_vocab_size` present and `num_hidden_layers == 1` (conversion/llama.py:50); architecture
  `LlamaForCausalLMEagle3` registered (conversion/llama.py:25).
- `eagle_aux_hidden_state_layer_ids`, TOP-LEVEL only (conversion/llama.py:77; absent -> [2, L//2, L-3], :81),
  written to `eagle3.target_layers`. At run time id k < L turns on the INPUT of target layer k
  (common/speculative.cpp:543, llama_set_embeddings_layer_inp; src/models/llama.cpp:127 t_layer_inp[il] = inpL),
  i.e. hidden_states[k] in HF's tuple: our convention unchanged. Id L is the final PRE-norm state
  (src/llama-graph.h:941) while ours is post-norm, so heads reading layer L are refused. Exactly 3 ids
  (src/models/eagle3.cpp:9).
- `target_hidden_size` (conversion/llama.py:86), `norm_before_residual` (:96; false = residual on the raw fc
  output, as our midlayer does: src/models/eagle3.cpp inpSA), `norm_before_fc` (:102; false: our fc reads the raw
  concatenated features). All three written explicitly.
- `d2t` as OFFSETS, target id = i + d2t[i]: the converter adds arange and stores absolute I64 ids
  (conversion/llama.py:345); `t2d` is dropped (:247). The fc has no bias in llama.cpp (src/models/eagle3.cpp fc).
- RoPE base from `rope_parameters.rope_theta` / `rope_theta` (conversion/base.py:1359-1371, :1505), RMSNorm eps
  from `rms_norm_eps` (:1511). No `embed_tokens` in the draft: llama.cpp uses the target's (src/models/eagle3.cpp).
DSpark / DFlash heads (the speculators dspark layout, then the keys below) are read by `DSparkModel`
(conversion/qwen.py:861-949, on DFlashModel :664-858) into the `dflash` GGUF architecture:
- `architectures` DSparkSpeculator (registered :861-867; DFlashSpeculator is not, so DFlash heads use it too: the
  runtime adds the Markov head only when `markov_w1` exists, src/models/dflash.cpp:125-137, :849).
- `block_size`, from `dflash_config` or top level, DEFAULT 16 when absent (:710); `sample_from_anchor`, default
  true only without `transformer_layer_config` / aux ids (:879-881), i.e. false for a speculators folder that
  omits it; `mask_token_id` (:696-698 -> tokenizer.ggml.mask_token_id); `aux_hidden_state_layer_ids` stored as
  `id - 1` (:888-892) and written `+ 1` (:735-738), so `dflash.target_layers` = ours, fed as target layer inputs
  (common/speculative.cpp:1056-1059); `dflash_config.causal` false (:749-753; the block is bidirectional).
- `markov_head_type` vanilla only (:898); `draft_vocab_size` (:902) with `d2t` offsets written absolute
  (:938-949), `t2d` dropped (:917), `lm_head` dropped with a full vocabulary (:926: the target's output is used,
  src/models/dflash.cpp:802-811, as our head does); `has_confidence_head` from `confidence_head.proj` (:912).
- Qwen3 layers with q/k norms (src/models/dflash.cpp:234-235), NeoX RoPE (src/llama-model.cpp:3179-3185), the
  context's keys/values from RMSNorm(fc(features)) without the input norm (:606-640), as ours; confidence
  sigmoid(conf_proj [h_k ; W1[x_prev]] + b) on the final-normed hidden (:368-381, :797-800).
Refused: EAGLE-3.1 heads (head.eagle3.fc_norm / norm_output: the converter maps no `fc_norm.*` tensor, and
src/models/eagle3.cpp has only the one `norm_before_fc` norm and feeds its pre-norm state to the next step, :286),
gated / rnn Markov heads, a confidence head without the Markov input, feature layer L, activations
other than SiLU (no hidden_act is written), RoPE scaling the converter does not write, and the anchor-features
variant. The per-slot confidence temperatures have no slot in the GGUF (gguf_export.json lists them).
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from specheads.heads.base import CONFIG_NAME, WEIGHTS_NAME, HeadConfig, read_head_config
from specheads.heads.locate import INDEX_NAME, head_folder, read_weights
from specheads.heads.export import check_block_exportable, export_head
from specheads.heads.kinds import kind_spec, kinds, resolve
from specheads.target import full_attention_rope, resolve_target_path, target_fingerprint
from specheads.utils import SpecheadsError, atomic_dir, atomic_write_json, cache_root, read_json

log = logging.getLogger(__name__)

LLAMACPP_PIN = "llama-cpp-python==0.3.36"  # scripts/setup_llamacpp.sh builds its vendor/llama.cpp
SETUP_HINT = "run `make llamacpp` (scripts/setup_llamacpp.sh)"
OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # the converter's --outtype choices we pass through
DEFAULT_OUTTYPE = "bf16"  # bf16 never takes ggml's AMX-INT8 path
CONVERT_TIMEOUT_S = 3600  # room for converting a large target
DRAFT_NAME, TARGET_NAME, MANIFEST_NAME = "draft.gguf", "target.gguf", "gguf_export.json"


# ----------------------------------------------------------------------------------------------- the tools
def llamacpp_root() -> Path:
    """$SPECHEADS_LLAMACPP, default <repository>/.llamacpp (where `make llamacpp` builds)."""
    env = os.environ.get("SPECHEADS_LLAMACPP")
    return Path(env) if env else Path(__file__).resolve().parents[2] / ".llamacpp"


@dataclass(frozen=True)
class LlamaCppTools:
    root: Path

    @property
    def converter(self) -> Path:
        return self.root / "src" / "convert_hf_to_gguf.py"

    def binary(self, name: str) -> Path:
        return self.root / "build" / "bin" / name

    @property
    def version(self) -> str:
        p = self.root / "version.txt"
        return p.read_text().strip().splitlines()[0] if p.exists() else "unknown"


def find_tools(*binaries: str, converter: bool = False) -> LlamaCppTools:
    """The built tools, or one SpecheadsError naming what is missing and how to get it."""
    tools = LlamaCppTools(llamacpp_root())
    if not (tools.root / "stamp").exists():
        raise SpecheadsError(f"llama.cpp tools are not built in {tools.root} (no stamp file): {SETUP_HINT}")
    missing = [str(tools.binary(b)) for b in binaries if not os.access(tools.binary(b), os.X_OK)]
    if converter and not tools.converter.exists():
        missing.append(str(tools.converter))
    if missing:
        raise SpecheadsError(f"llama.cpp tools incomplete: {', '.join(missing)} missing: {SETUP_HINT}")
    if converter and importlib.util.find_spec("sentencepiece") is None:  # the converter imports it unconditionally
        raise SpecheadsError(f"the GGUF converter needs the Python package sentencepiece in {sys.executable}: "
                             f"{SETUP_HINT}")
    return tools


def run_converter(model_dir: Path, out_file: Path, outtype: str, target_dir: Path | None = None) -> Path:
    """convert_hf_to_gguf.py MODEL_DIR [--target-model-dir TARGET_DIR] --outtype T -> out_file (atomic), log beside."""
    if outtype not in OUTTYPES:
        raise SpecheadsError(f"--gguf-type {outtype!r}: expected one of {list(OUTTYPES)}")
    tools = find_tools(converter=True)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(f".{out_file.name}.tmp-{os.getpid()}")
    cmd = [sys.executable, str(tools.converter), str(model_dir), "--outfile", str(tmp), "--outtype", outtype]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    log_file = out_file.with_name(out_file.name + ".convert.log")
    t0 = time.perf_counter()
    log.info("converting %s -> %s (%s)", model_dir, out_file, outtype)
    try:
        with open(log_file, "w") as lf:
            lf.write(" ".join(cmd) + "\n")
            lf.flush()
            proc = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, timeout=CONVERT_TIMEOUT_S,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        tmp.unlink(missing_ok=True)
        raise SpecheadsError(f"convert_hf_to_gguf.py on {model_dir}: no result after {CONVERT_TIMEOUT_S} s "
                             f"(log: {log_file})") from None
    if proc.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        tail = [ln for ln in log_file.read_text().splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise SpecheadsError(f"convert_hf_to_gguf.py failed on {model_dir} (exit {proc.returncode}): {tail[0]} "
                             f"(log: {log_file})")
    os.replace(tmp, out_file)
    log.info("converted %s in %.1f s", out_file.name, time.perf_counter() - t0)
    return out_file


# ----------------------------------------------------------------------------------------------- reading GGUF
_VOCAB_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                 "tokenizer.ggml.merges")


def gguf_metadata(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(key/value metadata with arrays as lists, {tensor name: reader tensor}) of a GGUF file."""
    from gguf import GGUFReader  # the gguf package: only reading a GGUF needs it

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # a truncated or foreign file
        raise SpecheadsError(f"{path}: not a readable GGUF file ({e})") from None
    meta = {}
    for name, field in reader.fields.items():  # vocabulary-sized arrays: their length is what we check
        meta[name] = len(field.data) if name in _VOCAB_ARRAYS else field.contents()
    return meta, {t.name: t for t in reader.tensors}


def _expect(meta: dict, key: str, want: Any, path: Path, close: bool = False) -> None:
    got = meta.get(key)
    ok = got is not None and (abs(float(got) - float(want)) <= 1e-6 * max(1.0, abs(float(want))) if close
                              else got == want)
    if not ok:
        raise SpecheadsError(f"{path}: GGUF key {key!r} is {got!r}, expected {want!r} (the converter read our "
                             "config wrong)")


# ----------------------------------------------------------------------------------------------- targets
def _target_folder(name_or_path: str) -> Path:
    folder = Path(resolve_target_path(name_or_path))
    if not (folder / "config.json").exists():
        raise SpecheadsError(f"target {name_or_path!r}: the GGUF converter needs a local Hugging Face folder "
                             "(config.json, safetensors, tokenizer); give --target a folder or a .gguf file")
    return folder


def _folder_key(folder: Path, *extra: str) -> str:
    """Cache key of a model folder: its path, config and the size + mtime of every weight and tokenizer file."""
    h = hashlib.sha256(str(folder.resolve()).encode())
    for p in sorted(folder.iterdir()):
        if p.is_file() and (p.suffix in (".json", ".safetensors", ".model", ".txt")):
            st = p.stat()
            h.update(f"{p.name}|{st.st_size}|{int(st.st_mtime)}".encode())
    for e in extra:
        h.update(e.encode())
    return h.hexdigest()[:12]


def target_gguf(name_or_path: str, outtype: str = DEFAULT_OUTTYPE) -> Path:
    """The target as a GGUF file: a .gguf path as it is, else the HF folder converted once into
    $SPECHEADS_CACHE/gguf/ (keyed by the folder's files, the outtype and the pinned converter)."""
    if str(name_or_path).endswith(".gguf") and Path(name_or_path).exists():
        return Path(name_or_path)
    folder = _target_folder(name_or_path)
    out = cache_root() / "gguf" / f"{folder.name}-{_folder_key(folder, outtype, LLAMACPP_PIN)}-{outtype}.gguf"
    if not out.exists():
        run_converter(folder, out, outtype)
        check_target_gguf(out, read_json(folder / "config.json"))
    return out


def check_target_gguf(path: Path, hf_config: dict) -> None:
    """The converted target has the layer count, width and vocabulary of its HF config."""
    meta, _ = gguf_metadata(path)
    cfg = {**hf_config, **(hf_config.get("text_config") or {})}
    arch = meta.get("general.architecture")
    _expect(meta, f"{arch}.block_count", int(cfg["num_hidden_layers"]), path)
    _expect(meta, f"{arch}.embedding_length", int(cfg["hidden_size"]), path)
    _expect(meta, "tokenizer.ggml.tokens", int(cfg["vocab_size"]), path)


def _folder_fingerprint(folder: Path) -> dict | None:
    """target.fingerprint() computed from a folder's safetensors (embedding + lm_head), None if not found."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                if k.endswith("embed_tokens.weight") or k == "lm_head.weight":
                    tensors["lm_head" if k == "lm_head.weight" else "embed"] = st.get_tensor(k)
    if "embed" not in tensors:
        return None
    return target_fingerprint(tensors["embed"], tensors.get("lm_head", tensors["embed"]))


# ----------------------------------------------------------------------------------------------- draft kinds
@dataclass(frozen=True)
class DraftKind:
    """How one head kind reaches llama.cpp: the export layout the converter reads, the keys we set on top of it,
    the checks of the converted file, and the server's --spec-type."""

    layout: str  # export format (heads/export/) written as the converter's input folder
    spec_type: str  # llama-server --spec-type
    arch: str  # general.architecture of the converted draft
    check_head: Callable[[HeadConfig, Path], None]
    converter_config: Callable[[HeadConfig, dict], dict]  # (head config, exported config.json) -> config.json
    check_gguf: Callable[[HeadConfig, dict, dict, Path], None]  # (head config, metadata, tensors, path)
    notes: Callable[[HeadConfig, Path], dict] = lambda cfg, head_dir: {}  # gguf_export.json extras: server_args
    marker: str = ""  # a metadata key only this kind's drafts carry: tells kinds of one architecture apart


def _rope_theta(cfg: HeadConfig) -> float:
    tc = cfg.target_config
    rope = full_attention_rope(tc.get("rope_parameters")) or {}  # per-layer-type RoPE: the draft's full-attention
    return float(rope.get("rope_theta", tc.get("rope_theta", 10000.0)))


DSPARK_ENGINE = "llama.cpp's DSpark draft (converter conversion/qwen.py DSparkModel, runtime src/models/dflash.cpp)"


def _dspark_check_head(cfg: HeadConfig, head_dir: Path) -> None:
    """What llama.cpp's DFlash / DSpark graph cannot run, refused with the reason (file:line in vendor/llama.cpp)."""
    spec = cfg.head_spec
    check_block_exportable(cfg, "--format gguf", DSPARK_ENGINE, str(head_dir))
    problems = []
    if spec.options.markov_rank and spec.options.markov_head_type != "vanilla":
        problems.append(f"its Markov head is {spec.options.markov_head_type!r} and llama.cpp runs the vanilla one only "
                        "(conversion/qwen.py:898; the bias W2 W1[x_prev] of src/models/dflash.cpp:350-351)")
    if spec.options.confidence_head and not spec.options.confidence_with_markov:
        problems.append("its confidence head reads h_k alone and llama.cpp's reads [h_k ; W1[x_prev]] "
                        "(conf_proj of D + rank inputs, loaded beside a Markov head: src/models/dflash.cpp:126-134)")
    problems += dflash_backbone_problems(cfg)
    if problems:
        raise SpecheadsError(f"--format gguf: {head_dir}: {DSPARK_ENGINE} cannot run this head: "
                             + "; ".join(problems))


def dflash_backbone_problems(cfg: HeadConfig) -> list[str]:
    """What the block backbone of llama.cpp's dflash architecture (DSpark, DFlash, DFlash2) cannot run."""
    tc, L = cfg.target_config, int(cfg.target_config["num_hidden_layers"])
    problems = []
    if L in cfg.feature_layers:
        problems.append(f"feature layer {L} is our final post-norm state, and llama.cpp feeds the pre-norm state "
                        "for that id")
    if tc.get("hidden_act", "silu") != "silu":
        problems.append(f"its MLP activation is {tc['hidden_act']!r}: the converter writes no hidden_act and "
                        "llama.cpp's DFlash then runs SiLU (src/models/dflash.cpp:13-21)")
    rope = (tc.get("rope_parameters") or tc.get("rope_scaling") or {}).get("rope_type", "default")
    if rope not in ("default", "linear", "yarn"):
        problems.append(f"RoPE type {rope!r}: the converter writes the scaling of linear / yarn only "
                        "(conversion/base.py:1462-1494)")
    return problems


def _dspark_converter_config(cfg: HeadConfig, config: dict) -> dict:
    """The speculators dspark export plus every key DSparkModel / DFlashModel read, set explicitly: the
    architecture it registers (DFlash heads too: DFlashSpeculator is not registered), block_size (default 16
    when absent), sample_from_anchor (default true only without transformer_layer_config), mask token,
    hidden_states ids (the converter stores id - 1 and writes + 1) and non-causal attention."""
    spec, ids = cfg.head_spec, list(cfg.feature_layers)
    K = spec.options.block_size
    config = dict(config)
    config.update(architectures=["DSparkSpeculator"], block_size=K,  # conversion/qwen.py:861-867, :710
                  sample_from_anchor=spec.options.sample_from_anchor,  # :879-881
                  mask_token_id=spec.mask_token_id, aux_hidden_state_layer_ids=ids,  # :888-892
                  draft_vocab_size=cfg.out_vocab, markov_head_type="vanilla",  # :898, :902
                  dflash_config={"block_size": K, "mask_token_id": spec.mask_token_id,  # :696, :710
                                 "target_layer_ids": [i - 1 for i in ids], "causal": False})  # :735-738, :749-753
    return config


def _dspark_check_gguf(cfg: HeadConfig, meta: dict, tensors: dict, path: Path) -> None:
    spec = cfg.head_spec
    o = spec.options
    for key, want in [("general.architecture", "dflash"), ("dflash.target_layers", list(cfg.feature_layers)),
                      ("dflash.block_size", o.block_size), ("dflash.sample_from_anchor", o.sample_from_anchor),
                      ("dflash.has_confidence_head", o.confidence_head), ("dflash.attention.causal", False),
                      ("tokenizer.ggml.mask_token_id", spec.mask_token_id), ("dflash.block_count", spec.num_layers),
                      ("dflash.embedding_length", cfg.hidden_size)]:
        _expect(meta, key, want, path)
    _expect(meta, "dflash.rope.freq_base", _rope_theta(cfg), path, close=True)
    _expect(meta, "dflash.attention.layer_norm_rms_epsilon", float(cfg.target_config["rms_norm_eps"]), path,
            close=True)
    need = ["fc.weight", "enc.output_norm.weight", "output_norm.weight"]
    need += [f"blk.{i}.attn_{n}_norm.weight" for i in range(spec.num_layers) for n in ("q", "k")]
    need += ["markov_w1.weight", "markov_w2.weight"] if spec.options.markov_rank else []
    need += ["conf_proj.weight", "conf_proj.bias"] if spec.options.confidence_head else []
    need += ["output.weight", "d2t"] if cfg.draft_vocab_size else []
    for name in need:
        if name not in tensors:
            raise SpecheadsError(f"{path}: tensor {name!r} missing from the converted draft")
    if cfg.draft_vocab_size and int(tensors["output.weight"].shape[-1]) != cfg.out_vocab:
        raise SpecheadsError(f"{path}: output.weight has {tensors['output.weight'].shape[-1]} rows, the head's "
                             f"draft vocabulary {cfg.out_vocab}")
    if not cfg.draft_vocab_size and "output.weight" in tensors:  # ours is the target's lm_head, llama.cpp's too
        raise SpecheadsError(f"{path}: a full-vocabulary draft carries output.weight; llama.cpp would use it "
                             "instead of the target's output projection")


def _dspark_notes(cfg: HeadConfig, head_dir: Path) -> dict:
    spec = cfg.head_spec
    notes = {"server_args": ["--spec-draft-n-max", str(spec.num_drafts)],
             "block": f"--spec-draft-n-max {spec.num_drafts} runs the block as trained "
                      f"({spec.options.block_size} slots); "
                      "a smaller N decodes a shorter block, whose bidirectional attention differs from training"}
    if spec.options.confidence_head:
        notes["confidence"] = ("--spec-draft-p-min P stops the draft at the first slot whose confidence "
                               "sigmoid(w . [h_k ; W1[x_prev]] + b) is below P (per slot, not the survival product; "
                               "common/speculative.cpp:1267-1276); the GGUF carries the uncalibrated head "
                               "(its per-slot temperatures and biases have no slot there)")
        sd = read_weights(Path(head_dir))[0]
        notes["conf_temperature_not_in_gguf"] = [round(float(t), 4) for t in sd["conf_temperature"]]
        if "conf_bias" in sd:
            notes["conf_bias_not_in_gguf"] = [round(float(b), 4) for b in sd["conf_bias"]]
    return notes


# How the kinds llama.cpp drafts with reach it; a kind's KindSpec.gguf names its entry: DSpark's here, EAGLE-3's in
# heads/eagle3_gguf.py, DFlash2's in heads/dflash2_gguf.py
DSPARK_DRAFT = DraftKind("speculators", "draft-dspark", "dflash", _dspark_check_head, _dspark_converter_config,
                         _dspark_check_gguf, _dspark_notes)


# ----------------------------------------------------------------------------------------------- the export
def draft_kinds() -> dict[str, DraftKind]:
    """Head kind -> its DraftKind, for the kinds llama.cpp drafts with (KindSpec.gguf)."""
    return {k: resolve(s.gguf) for k, s in kinds().items() if s.gguf}


def __getattr__(name: str):
    """DRAFT_KINDS and NOT_DRAFTED (kind -> why llama.cpp cannot draft with it): views of the kind registry."""
    if name == "DRAFT_KINDS":
        return draft_kinds()
    if name == "NOT_DRAFTED":
        return {k: s.not_drafted for k, s in kinds().items() if s.not_drafted}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _draft_kind(cfg: HeadConfig, head_dir: Path) -> DraftKind:
    ks, drafted = kind_spec(cfg.kind), draft_kinds()
    if cfg.kind not in drafted:
        why = f" ({ks.not_drafted})" if ks.not_drafted else ""
        raise SpecheadsError(f"--format gguf: {head_dir} holds a {cfg.kind} head; llama.cpp drafts with "
                             f"{sorted(drafted)} heads{why}")
    return drafted[cfg.kind]


def resolve_head_target(cfg: HeadConfig, head_dir: Path, target: str | None = None,
                        allow_other_target: bool = False) -> Path:
    """The target HF folder the draft is converted against: `target` or the one the head records, checked
    against the head's fingerprint (a draft paired with another target's GGUF would run but draft nonsense), unless
    `allow_other_target` (--allow-other-target: `specheads export` compared the whole target and warned)."""
    folder = _target_folder(target or cfg.target_name)
    fp = _folder_fingerprint(folder)
    if fp is not None and fp != cfg.fingerprint and not allow_other_target:
        raise SpecheadsError(f"--target {target or cfg.target_name}: {folder} is not the target {head_dir} was "
                             "trained on (embedding / lm_head fingerprints differ)")
    if fp is None:
        log.warning("%s: no embed_tokens in its safetensors; the head's target fingerprint is not checked", folder)
    return folder


def convert_draft(head_dir: str | Path, out_file: Path, target: str | None = None,
                  outtype: str = DEFAULT_OUTTYPE, allow_other_target: bool = False) -> Path:
    """One native head folder -> a checked draft GGUF at out_file."""
    find_tools(converter=True)  # before any work: one clear error when they are missing
    head_dir = Path(head_dir)
    cfg = read_head_config(head_dir)
    kind = _draft_kind(cfg, head_dir)
    kind.check_head(cfg, head_dir)
    target_dir = resolve_head_target(cfg, head_dir, target, allow_other_target)
    with tempfile.TemporaryDirectory(prefix="specheads-gguf-") as tmp:
        hf = Path(tmp) / "draft-hf"
        export_head(head_dir, kind.layout, hf)
        atomic_write_json(hf / CONFIG_NAME, kind.converter_config(cfg, read_json(hf / CONFIG_NAME)))
        run_converter(hf, out_file, outtype, target_dir=target_dir)
    check_draft_gguf(out_file, cfg, head_dir)
    return out_file


def check_draft_gguf(path: Path, cfg: HeadConfig, head_dir: Path | None = None) -> None:
    """Read the converted draft back: every convention the engine uses, and d2t (absolute ids) equal to ours."""
    kind = _draft_kind(cfg, head_dir or path)
    meta, tensors = gguf_metadata(path)
    kind.check_gguf(cfg, meta, tensors, path)
    want = torch.arange(cfg.out_vocab)
    if cfg.draft_vocab_size and head_dir is not None:
        want = read_weights(Path(head_dir))[0]["d2t"].to(torch.int64)
    if "d2t" not in tensors and not cfg.draft_vocab_size:  # a full-vocabulary DSpark draft has no map
        return
    got = torch.as_tensor(tensors["d2t"].data.copy()).to(torch.int64).reshape(-1)
    if not torch.equal(got, want):
        raise SpecheadsError(f"{path}: d2t does not hold the head's draft -> target ids (offsets read wrong)")


def draft_gguf(head_dir: str | Path, target: str | None = None, outtype: str = DEFAULT_OUTTYPE) -> Path:
    """A head folder as a draft GGUF, converted once into $SPECHEADS_CACHE/gguf/heads/ (keyed by the head's
    files and the target folder); a .gguf path is returned as it is."""
    if str(head_dir).endswith(".gguf"):
        if not Path(head_dir).exists():
            raise SpecheadsError(f"{head_dir}: draft GGUF not found")
        return Path(head_dir)
    head_dir = head_folder(head_dir)  # a folder or a hub id (heads/locate.py)
    cfg = read_head_config(head_dir)
    h = hashlib.sha256()
    weights = [WEIGHTS_NAME] if (head_dir / WEIGHTS_NAME).is_file() else \
        [INDEX_NAME, *sorted(p.name for p in head_dir.glob("*.safetensors"))]  # a sharded head: its index and shards
    for name in (CONFIG_NAME, *weights):
        h.update((head_dir / name).read_bytes())
    h.update(_folder_key(_target_folder(target or cfg.target_name), outtype, LLAMACPP_PIN).encode())
    out = cache_root() / "gguf" / "heads" / f"{head_dir.name}-{h.hexdigest()[:12]}-{outtype}.gguf"
    return out if out.exists() else convert_draft(head_dir, out, target, outtype)


def spec_type_of(draft: Path) -> str:
    """llama-server --spec-type for a draft GGUF, from its architecture."""
    meta = gguf_metadata(draft)[0]
    arch = meta.get("general.architecture")
    same = [k for k in draft_kinds().values() if k.arch == arch]  # a marked kind first, when its key is there
    for kind in [k for k in same if k.marker and k.marker in meta] + [k for k in same if not k.marker]:
        return kind.spec_type
    raise SpecheadsError(f"{draft}: GGUF architecture {arch!r} is not a draft specheads drives "
                         f"({[k.arch for k in draft_kinds().values()]})")


def export_gguf(head_dir: str | Path, out_dir: str | Path, target: str | None = None, with_target: bool = False,
                outtype: str = DEFAULT_OUTTYPE, allow_other_target: bool = False) -> Path:
    """`specheads export --format gguf`: out_dir/draft.gguf (+ target.gguf with `with_target`) and
    gguf_export.json (what was converted, with the llama-server command), written atomically."""
    head_dir = Path(head_dir)
    cfg = read_head_config(head_dir)
    kind = _draft_kind(cfg, head_dir)
    kind.check_head(cfg, head_dir)
    find_tools(converter=True)
    with atomic_dir(out_dir) as tmp:
        convert_draft(head_dir, tmp / DRAFT_NAME, target, outtype, allow_other_target)
        (tmp / (DRAFT_NAME + ".convert.log")).unlink(missing_ok=True)
        manifest: dict[str, Any] = {
            "draft": DRAFT_NAME, "head": str(head_dir), "kind": cfg.kind, "outtype": outtype,
            "target": target or cfg.target_name, "feature_layers": list(cfg.feature_layers),
            "converter": f"vendor/llama.cpp/convert_hf_to_gguf.py of {LLAMACPP_PIN}",
            "llama_server": f"llama-server -m TARGET.gguf -md {DRAFT_NAME} --spec-type {kind.spec_type}"}
        manifest.update(kind.notes(cfg, head_dir))
        manifest["llama_server"] = " ".join([manifest["llama_server"], *manifest.get("server_args", [])])
        if with_target:
            src = target_gguf(target or cfg.target_name, outtype)
            try:
                os.link(src, tmp / TARGET_NAME)  # the cached conversion, without a second copy on disk
            except OSError:
                shutil.copyfile(src, tmp / TARGET_NAME)
            manifest.update(target_gguf=TARGET_NAME, llama_server=manifest["llama_server"].replace(
                "TARGET.gguf", TARGET_NAME))
        atomic_write_json(tmp / MANIFEST_NAME, manifest)
    log.info("exported %s head %s as GGUF to %s", cfg.kind, head_dir, out_dir)
    return Path(out_dir)
