"""Which safetensors file of a model folder holds each tensor, tensors read by name (safe_open) or sampled at their
byte offsets, and the check that a folder holds its decoder layers (before a whole-target load). Imports nothing
of specheads but utils, so that target.py and target_parts.py both use it."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from specheads.utils import SpecheadsError, read_text_bounded


class SafetensorsIndex:
    """Which safetensors file holds each tensor of a folder (model.safetensors.index.json, else every *.safetensors
    header); tensors are read by name, one at a time, with safe_open (nothing else of the file is read)."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                wm = json.loads(read_text_bounded(index))["weight_map"]
            except (ValueError, KeyError, TypeError):
                raise SpecheadsError(f"{index}: not a safetensors index (no weight_map)") from None
            self.where = {str(k): folder / str(v) for k, v in wm.items()}
        else:
            self.where = {}
            for f in sorted(folder.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as h:
                    self.where.update({k: f for k in h.keys()})
        if not self.where:
            raise SpecheadsError(f"{folder}: no safetensors weights (model.safetensors or an index)")

    def missing(self, names) -> list[str]:
        return [n for n in names if n not in self.where]

    def tensor(self, name: str, target_name: str) -> torch.Tensor:
        from safetensors import safe_open

        f = self.where.get(name)
        if f is None or not f.is_file():
            raise SpecheadsError(f"target {target_name!r}: {self.folder} has no tensor {name} "
                                 f"({'not in its files' if f is None else f'{f.name} is missing'})")
        with safe_open(str(f), framework="pt") as h:
            return h.get_tensor(name)

    def samples(self, name: str, positions: torch.Tensor) -> torch.Tensor:
        """The elements of tensor `name` at flat `positions`, read from the file at their byte offsets (the
        safetensors header gives each tensor's dtype and data offsets; nothing else of the tensor is read)."""
        import numpy as np

        f = self.where[name]
        header, base = self._header(f)
        info = header[name]
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise SpecheadsError(f"{f}: tensor {name} has dtype {info['dtype']}, which the record cannot sample")
        size = torch.empty(0, dtype=dtype).element_size()
        start = base + int(info["data_offsets"][0])
        mm = np.memmap(f, dtype=np.uint8, mode="r")
        offs = start + positions.numpy()[:, None] * size + np.arange(size)[None, :]
        raw = np.ascontiguousarray(mm[offs.reshape(-1)])
        return torch.frombuffer(bytearray(raw.tobytes()), dtype=dtype).clone()

    def _header(self, f: Path) -> tuple[dict, int]:
        cache = self.__dict__.setdefault("_headers", {})
        if f not in cache:
            import struct

            with open(f, "rb") as h:
                n = struct.unpack("<Q", h.read(8))[0]
                cache[f] = (json.loads(h.read(n)), 8 + n)
        return cache[f]


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def check_decoder_present(folder: Path, name: str) -> None:
    """Before a whole-target load of a local folder: every decoder layer 0..L-1 has tensors in its safetensors
    files. A folder stripped for offline training would otherwise load with random decoder layers (transformers
    initialises missing weights with a warning): one SpecheadsError naming the missing layers instead."""
    try:
        cfg = json.loads(read_text_bounded(Path(folder) / "config.json"))
        cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
        L = int(cfg["num_hidden_layers"])
        files = SafetensorsIndex(Path(folder))
    except (OSError, ValueError, KeyError, TypeError, SpecheadsError):
        return  # not this check's to judge: the load itself says what is wrong
    present = {int(p) for n in files.where for p in _layer_ids(n)}
    missing = [i for i in range(L) if i not in present]
    if missing:
        some = ", ".join(map(str, missing[:4])) + (" ..." if len(missing) > 4 else "")
        raise SpecheadsError(f"target {name!r}: {folder} has no tensors of decoder layers {some} ({len(missing)} of "
                             f"{L} layers missing, e.g. model.layers.{missing[0]}.*): a folder without its decoder "
                             f"serves only offline training (`specheads train` reads its embeddings, final norm and "
                             f"lm_head); this needs the full target")


def _layer_ids(name: str) -> list[str]:
    parts = name.split(".")
    return [parts[i + 1] for i, p in enumerate(parts[:-1]) if p in ("layers", "h") and parts[i + 1].isdigit()][:1]
