"""The frozen target model and the facts heads need about it.

`load_target(name_or_path)` accepts a hub id, a local HF folder, a `.gguf` file, or the alias `smollm2-135m`.
GGUF files are dequantised once (about 18 s for SmolLM2) and converted into `$SPECHEADS_CACHE/targets/<key>` as
safetensors plus tokenizer, written atomically; later loads read that folder in well under a second.
Architecture facts are read from the model and its config, never from per-architecture copies of modeling code.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specheads.utils import DTYPE_NAMES, SpecheadsError, atomic_dir, cache_root, read_text_bounded, template_kwargs

log = logging.getLogger(__name__)

DTYPES = {alias: getattr(torch, name) for alias, name in DTYPE_NAMES.items()}  # utils.DTYPE_NAMES, as torch dtypes


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise SpecheadsError(f"dtype {dtype!r}: expected one of {sorted(DTYPES)}") from None


@dataclass
class Target:
    """A frozen causal LM plus its tokenizer. B batch, T sequence, D hidden, V vocab."""

    model: nn.Module  # *ForCausalLM, eval mode, requires_grad False
    tokenizer: Any
    name: str  # what the user asked for (alias, path or hub id); recorded in head configs
    engine: str = "auto"  # the decoding forward (infer/engine/runner.py): auto | owned | hf
    compile: str = "auto"  # compiled steps of the owned forward (C++ kernels on a CPU, CUDA graphs): auto | on | off
    gguf: str | None = None  # the .gguf file it was converted from (recorded with its quantization by heads)
    allow_other_target: bool = False  # --allow-other-target: heads trained on other weights load, with a warning
    placement: str = ""  # how target.device_map resolved, for the log lines (where_target_runs)

    @property
    def config(self):
        return self.model.config

    @property
    def text_config(self):
        cfg = self.model.config
        return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def num_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.weight.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def base(self) -> nn.Module:
        """The decoder stack without the output head (calling it is ~30% cheaper than the full LM on small vocabularies)."""
        get = getattr(self.model, "get_decoder", None)
        dec = get() if get is not None else None
        return dec if dec is not None else self.model.base_model

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def final_norm(self) -> nn.Module:
        for name in ("norm", "final_layernorm", "ln_f"):
            m = getattr(self.base, name, None)
            if isinstance(m, nn.Module):
                return m
        raise SpecheadsError(f"target {self.name}: cannot find the final norm of {type(self.base).__name__}")

    @property
    def max_positions(self) -> int | None:
        return getattr(self.text_config, "max_position_embeddings", None)

    @property
    def eos_token_ids(self) -> list[int]:
        ids: list[int] = []
        for src in (getattr(self.model, "generation_config", None), self.config):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            for i in ([e] if isinstance(e, int) else (e or [])):
                if i not in ids:
                    ids.append(int(i))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(int(self.tokenizer.eos_token_id))
        return ids

    def fingerprint(self) -> dict:
        """Shapes plus a hash of a few rows of the embedding and lm_head: heads record it and check it on load."""
        return target_fingerprint(self.embed_tokens.weight, self.lm_head.weight)

    def record(self) -> dict:
        """The whole target's record heads keep (family, every tensor's sampled hash, the GGUF source):
        specheads/target_record.py."""
        from specheads.target_record import target_record

        return target_record(self)

    def describe(self) -> str:
        """What it decodes, for the load line and the bench's results header: 'smollm2-135m
        (SmolLM2-135M-Instruct.Q4_1.gguf dequantised to bfloat16)', a folder or hub id as 'NAME (bfloat16)'."""
        dtype = str(self.dtype).removeprefix("torch.")
        if self.gguf:
            return f"{self.name} ({Path(self.gguf).name} dequantised to {dtype})"
        return f"{self.name} ({dtype})"


def target_fingerprint(embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, rows: int = 8) -> dict:
    def h(w: torch.Tensor) -> str:
        idx = torch.linspace(0, w.shape[0] - 1, steps=min(rows, w.shape[0])).long()
        sample = w.detach()[idx].float().cpu()
        # Round so that bf16 and fp32 copies of the same weights agree.
        sample = torch.round(sample.to(torch.bfloat16).float() * 1e3).to(torch.int64)
        return hashlib.sha256(sample.numpy().tobytes()).hexdigest()[:16]

    return {"embed_shape": list(embed_weight.shape), "lm_head_shape": list(lm_head_weight.shape),
            "embed_hash": h(embed_weight), "lm_head_hash": h(lm_head_weight)}


def _gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:12]
    return cache_root() / "targets" / f"{gguf.stem}-{key}"


def check_gguf(gguf: Path) -> None:
    """Before the conversion reads it: `gguf` is a whole GGUF file (one SpecheadsError naming it when it is empty,
    does not start with the GGUF magic, or its header or tensors do not fit in the file: truncated or damaged).
    The reader maps the file (no copy in memory)."""
    size = gguf.stat().st_size if gguf.is_file() else -1
    if size < 0:
        raise SpecheadsError(f"{gguf}: not a file (a GGUF target is one .gguf file)")
    with open(gguf, "rb") as f:
        magic = f.read(4)
    if size == 0 or magic != b"GGUF":
        what = "an empty file (0 bytes)" if size == 0 else f"does not start with the GGUF magic bytes ({magic!r})"
        raise SpecheadsError(f"{gguf}: not a GGUF file: {what}")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf))
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as e:  # noqa: BLE001 - the reader's struct / numpy errors on a cut or damaged header
        msg = str(e).splitlines()[0][:200] if str(e) else ""
        raise SpecheadsError(f"{gguf}: not a readable GGUF file, truncated or damaged ({size} bytes; "
                             f"{type(e).__name__}: {msg})") from None
    if end > size or not reader.tensors:
        what = "holds no tensors" if not reader.tensors else f"its tensors end at byte {end}, the file at {size}"
        raise SpecheadsError(f"{gguf}: truncated or damaged GGUF file ({what})")


def convert_gguf(gguf: Path, trust_remote_code: bool = False) -> Path:
    """Dequantise a GGUF file once into a safetensors + tokenizer folder in the cache; return that folder. The file
    is checked first (`check_gguf`); an architecture or layout transformers cannot convert is one line naming it."""
    out = _gguf_cache_dir(gguf)
    if (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf(gguf)
    log.info("converting %s into %s (one time, ~20 s)", gguf, out)
    try:
        with quiet_loading():
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                         dtype=torch.float32, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, IndexError, TypeError, RuntimeError) as e:
        msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        raise SpecheadsError(f"{gguf}: transformers cannot convert this GGUF file ({type(e).__name__}: {msg})") from None
    # transformers refuses save_pretrained on a dequantised GGUF model unless the quantizer is detached.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


def resolve_target_path(name_or_path: str) -> str:
    """Map an alias or .gguf file to a loadable folder; hub ids and folders pass through."""
    from specheads.assets import TARGET_ALIASES

    if name_or_path in TARGET_ALIASES:
        name_or_path = str(TARGET_ALIASES[name_or_path]())
    p = Path(name_or_path)
    if p.suffix == ".gguf":
        if not p.exists():
            raise SpecheadsError(f"{p}: GGUF file not found")
        return str(convert_gguf(p))
    if p.exists() and p.is_dir() and not (p / "config.json").exists():
        raise SpecheadsError(f"{p}: folder has no config.json (not a Hugging Face model folder)")
    return name_or_path


REMOTE_CODE = ("needs the model's own Python code (trust_remote_code); specheads runs no code from a model unless "
               "asked: set target.trust_remote_code=true in the recipe if you trust it")
PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def check_target_folder(folder: Path, name: str, trust_remote_code: bool) -> None:
    """Before transformers reads a local target folder: one SpecheadsError when it would run the folder's own code
    (config.json `auto_map`) without trust_remote_code, or when its weights are pickles only (never unpickled)."""
    import json

    try:
        config = json.loads(read_text_bounded(folder / "config.json"))
    except (OSError, ValueError) as e:
        raise SpecheadsError(f"{folder / 'config.json'}: not a readable model config ({type(e).__name__})") from None
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if auto_map and not trust_remote_code:
        raise SpecheadsError(f"target {name!r}: {folder / 'config.json'} maps its classes to code in the folder "
                             f"(auto_map {sorted(auto_map)[:3]}); it {REMOTE_CODE}")
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not auto_map and model_type is not None and not _known_model_type(model_type):
        import transformers

        raise SpecheadsError(f"target {name!r}: {folder / 'config.json'} has model_type {model_type!r}, which "
                             f"transformers {transformers.__version__} does not know (a newer transformers, a typo, "
                             f"or a model that needs its own code)")
    names = [p.name for p in folder.iterdir() if p.is_file()]
    pickled = sorted(n for n in names if n.endswith(PICKLED))
    if pickled and not any(n.endswith(".safetensors") or n.endswith(".safetensors.index.json") for n in names):
        raise SpecheadsError(f"target {name!r}: {folder} holds its weights only as pickles ({', '.join(pickled[:3])})"
                             f"; specheads never unpickles (it can run code): save the model as safetensors first "
                             f"(from_pretrained(...).save_pretrained(DIR) writes model.safetensors)")


def _known_model_type(model_type) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


@contextlib.contextmanager
def quiet_loading(local: bool = True):
    """transformers' "Loading weights" bar off while a local model loads (the load is one log line instead,
    `load_target`); a hub load (local False) keeps its bars, a download's progress being worth seeing."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if local and was:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if local and was:
            hf_logging.enable_progress_bar()


def load_target(name_or_path: str = "smollm2-135m", dtype: str | torch.dtype = "float32", device: str | None = None,
                trust_remote_code: bool = False, attn_implementation: str | None = "sdpa", device_map=None,
                rank: tuple[int, int] | None = None, role: str = "target") -> Target:
    """Load a frozen target (eval mode, no gradients), logging one line: `role`, what it decodes (`describe`) and
    the load's seconds. See the module docstring for what `name_or_path` may be.
    `device_map` (target.device_map; `device` wins when both are given): auto, cpu, cuda, cuda:N or a mapping
    module name -> device, loaded through transformers' from_pretrained(device_map=...) (accelerate's big-model
    loading: `auto` splits a target larger than one GPU across the visible ones). `rank` (local rank, processes on
    this node) under several processes: `auto` and `cuda` take this rank's own GPUs (resolve_device_map)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    path = resolve_target_path(name_or_path)
    gguf = _gguf_source(name_or_path)
    torch_dtype = resolve_dtype(dtype)
    kwargs: dict = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    placement = ""
    if device_map is not None and not device:
        hf_map, max_memory, placement = resolve_device_map(device_map, rank)
        kwargs["device_map"] = hf_map
        if max_memory:
            kwargs["max_memory"] = max_memory
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if not Path(path).exists() and os.environ.get("HF_HUB_OFFLINE") == "1":
        raise SpecheadsError(f"target {name_or_path!r}: not a local path and HF_HUB_OFFLINE=1")
    if Path(path).is_dir():
        check_target_folder(Path(path), name_or_path, trust_remote_code)
        from specheads.safetensors_index import check_decoder_present  # a folder stripped for offline training

        check_decoder_present(Path(path), name_or_path)
    try:  # safetensors only: a hub repo of pickled weights alone is refused too (use_safetensors)
        with quiet_loading(Path(path).exists()):
            model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, **kwargs)
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise SpecheadsError(f"target {name_or_path!r}: cannot load ({str(e).splitlines()[0]})") from None
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise SpecheadsError(f"target {name_or_path!r}: {REMOTE_CODE}") from None
        msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__  # e.g. a config of no causal LM class
        raise SpecheadsError(f"target {name_or_path!r}: cannot load ({msg})") from None
    except KeyError as e:  # transformers' mapping lookups for a model type it does not know
        raise SpecheadsError(f"target {name_or_path!r}: cannot load (transformers does not know {e})") from None
    if device:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    target = Target(model=model, tokenizer=tok, name=name_or_path, gguf=gguf, placement=placement)
    log.info("%s: %s loaded in %.1f s", role, target.describe(), time.perf_counter() - start)
    return target


DEVICE_MAP_WORDS = ("auto", "cpu", "cuda", "cuda:N")


def check_device_map(value, where: str = "target.device_map") -> None:
    """A device map as a recipe may give it: None, one of DEVICE_MAP_WORDS (N a GPU index), or a mapping module name
    -> cpu | cuda | cuda:N | N (accelerate's and transformers' form). Anything else is one SpecheadsError naming
    `where`. Whether the GPUs exist is checked at load time (resolve_device_map)."""
    if value is None:
        return
    if isinstance(value, dict):
        if not value:
            raise SpecheadsError(f"{where}: an empty mapping (give module name: device, e.g. {{'': cpu}}, or auto)")
        for k, v in value.items():
            if not isinstance(k, str) or _one_device(v) is None:
                raise SpecheadsError(f"{where}.{k}: {v!r} is not a device (cpu, cuda, cuda:N or a GPU index N; "
                                     f"every module must be placed on a real device)")
        return
    if not isinstance(value, str) or (value != "auto" and _one_device(value) is None):
        raise SpecheadsError(f"{where}: {value!r} is not one of {list(DEVICE_MAP_WORDS)} (N a GPU index) or a "
                             f"mapping module name -> device")


def _one_device(v) -> str | None:
    """'cpu', 'cuda' or 'cuda:N' for a device value of a map, None when it is none of them."""
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return f"cuda:{v}"
    if not isinstance(v, str):
        return None
    if v in ("cpu", "cuda"):
        return v
    head, _, n = v.partition(":")
    return v if head == "cuda" and n.isdigit() else None


def resolve_device_map(value, rank: tuple[int, int] | None = None, where: str = "target.device_map"):
    """target.device_map -> (device_map for from_pretrained, max_memory or None, placement note for the logs).
    `auto` without an accelerator is cpu (the note says so); under several processes (`rank` = (local rank,
    processes on this node)) `auto` and `cuda` mean this rank's GPUs: the node's GPUs cut into equal contiguous
    groups, one per process (a group of several: the target split across them, through max_memory). A GPU that is
    not there is one SpecheadsError naming `where`."""
    check_device_map(value, where)
    local, per_node = rank if rank is not None else (0, 1)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if value == "auto" and gpus == 0:
        return "cpu", None, "device_map auto found no accelerator"
    if value in ("auto", "cuda"):
        if gpus == 0:
            raise SpecheadsError(f"{where}: {value!r} but no CUDA device is visible (torch.cuda.is_available() is "
                                 f"False); use auto or cpu")
        share = gpus // max(per_node, 1)
        if share == 0:
            raise SpecheadsError(f"{where}: {per_node} processes on this node but {gpus} GPU(s): start at most "
                                 f"{gpus} processes per node, or use cpu")
        mine = list(range(local * share, local * share + share))
        if value == "cuda" or len(mine) == 1:
            return f"cuda:{mine[0]}", None, f"device_map {value}"
        if rank is None:
            return "auto", None, "device_map auto"
        memory = {i: int(torch.cuda.mem_get_info(i)[0] * 0.9) for i in mine}  # 10% left for activations
        return "auto", memory, f"device_map auto over this rank's GPUs {mine}"
    wanted = [_one_device(v) for v in (value.values() if isinstance(value, dict) else [value])]
    for d in wanted:
        n = int(d.split(":")[1]) if ":" in d else 0
        if d != "cpu" and n >= gpus:
            raise SpecheadsError(f"{where}: {d} but {gpus} CUDA device(s) visible")
    hf = {k: _one_device(v) for k, v in value.items()} if isinstance(value, dict) else value
    return hf, None, "device_map given per module" if isinstance(value, dict) else f"device_map {value}"


def target_devices(target) -> list[torch.device]:
    """The devices holding the target's parameters, in module order (several: a split target)."""
    seen: list[torch.device] = []
    for p in target.model.parameters():
        if p.device not in seen:
            seen.append(p.device)
    return seen


def where_target_runs(target) -> str:
    """What a stage's log line says: 'on cuda:0 (bfloat16)', 'on cpu (float32, device_map auto found no
    accelerator)', 'split over cuda:0, cuda:1 (bfloat16, device_map auto)'."""
    devs = [str(d) for d in target_devices(target)]
    what = ", ".join(x for x in (str(target.dtype).removeprefix("torch."), target.placement) if x)
    return f"{'on ' + devs[0] if len(devs) == 1 else 'split over ' + ', '.join(devs)} ({what})"


def _gguf_source(name_or_path: str) -> str | None:
    """The .gguf file an alias or path names (None for a folder or hub id)."""
    from specheads.assets import TARGET_ALIASES

    p = Path(str(TARGET_ALIASES[name_or_path]())) if name_or_path in TARGET_ALIASES else Path(name_or_path)
    return str(p) if p.suffix == ".gguf" and p.is_file() else None


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template, ending with the assistant generation prompt.
    The one prompt encoder: `generate`, `bench` and regeneration all call it (render text, then tokenise without
    adding special tokens again: the template already holds them). A tokenizer without a template (a base model)
    is one SpecheadsError pointing at plain-text prompts."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise SpecheadsError("the target's tokenizer has no chat template (a base model?): send plain text "
                             "(generate --raw, bench prompts with a \"prompt\" field, data.mode=text) or give it one")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **template_kwargs(tokenizer))  # data.chat_template_kwargs
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def tiny_target(vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 4, seed: int = 0,
                dtype: torch.dtype = torch.float32, tokenizer: Any = None, **overrides) -> Target:
    """A random-weight Llama target for fast tests (no download). B batch, T sequence, D hidden=64, V vocab=256."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, **overrides)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(dtype).eval().requires_grad_(False)
    return Target(model=model, tokenizer=tokenizer, name=f"tiny-llama-{seed}")


def full_attention_rope(rope_parameters: dict | None) -> dict | None:
    """The RoPE parameters of the target's full-attention layers, what a draft layer attending the whole context
    uses: `rope_parameters` as it is, or its "full_attention" entry when the config gives one per layer type
    (Gemma 3: {"sliding_attention": {...}, "full_attention": {...}})."""
    if not rope_parameters or not all(isinstance(v, dict) for v in rope_parameters.values()):
        return rope_parameters
    if "full_attention" in rope_parameters:
        return dict(rope_parameters["full_attention"])
    return dict(next(iter(rope_parameters.values())))


def tiny_gemma3_target(vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 4, seed: int = 0,
                       dtype: torch.dtype = torch.float32, tokenizer: Any = None, sliding_window: int = 8,
                       **overrides) -> Target:
    """A random-weight Gemma 3 target for fast tests: layers 0..L-2 sliding-window (window 8), the last full
    attention, RoPE per layer type (theta 1e4 sliding, 1e6 full). D hidden=64, V vocab=256, head_dim 16."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
              num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              sliding_window=sliding_window, layer_types=["sliding_attention"] * (num_layers - 1) + ["full_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
              max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              architectures=["Gemma3ForCausalLM"])  # what a loaded checkpoint's config carries
    cfg = Gemma3TextConfig(**{**kw, **overrides})
    cfg._attn_implementation = "sdpa"
    model = Gemma3ForCausalLM(cfg).to(dtype).eval().requires_grad_(False)
    return Target(model=model, tokenizer=tokenizer, name=f"tiny-gemma3-{seed}")
