"""Export a native head folder to the layouts serving engines read, and import those layouts (and the original
research repos' checkpoints) back. Safetensors only: nothing here unpickles a file. docs/exports.md cites each
consumer's loader (repository, commit, path) and says what was run and what only read.

One module per format family, each naming the loaders it matches and registering its formats (a `Format`: writer,
reader, detection, consumers and what they cannot read) with formats.py, which the shared modules look up:
- formats.py: the format registry (`register_format`, and `register_variant` for the model types one layout holds:
  speculators_model_type, SpecForge's projector_type, each registered by the module of the kind that writes it);
- registry.py: `export_head` / `import_head` and layout detection over the registered formats; native is our own
  format (HeadConfig and our state dict);
- consumers.py: the consumers of each format (the names `--consumer` takes) and what each cannot read
  (`consumer_problems`), refused naming the consumer and the reason;
- eagle.py: EAGLE-1, `eagle` (SGLang, the EAGLE repo) and `eagle-vllm` (vLLM);
- eagle3.py: EAGLE-3, `eagle3` (SGLang, vLLM, llama.cpp; the EAGLE-3 repo opt-in);
- speculators.py: EAGLE-3, `speculators` (speculators, and vLLM through it), whose reader dispatches on
  speculators_model_type;
- peagle.py: P-EAGLE's `speculators` writer (its KindSpec.writers) and reader;
- dflash2.py: DFlash2's `speculators` export (its KindSpec.exporter; its reader a speculators variant);
- dspark.py: DSpark / DFlash block heads, `speculators` (dspark / dflash) and `specforge` (SpecForge, SGLang);
- domino.py: Domino's SpecForge keys on that block export (its KindSpec.exporter) and its SpecForge reader;
- medusa.py: `medusa-vllm` (vLLM);
- repos.py: FasterDecoding Medusa checkpoints, `medusa-repo` (import only; EAGLE repo folders have the eagle /
  eagle3 layouts, whose RoPE base import_rope reads);
- common.py: what several loaders read alike (rope_theta, d2t offsets, the verifier's name).
Every non-native EAGLE / Medusa export also carries a `specheads` block: format, consumers checked, verifier,
feature layers. `--format gguf` is heads/gguf.py, which runs llama.cpp's converter on an export from here.
"""
from specheads.heads.export.common import (
    BUNDLED_TARGETS, HUB_IDS, SPECULATIVE_TOKENS, legacy_rope_keys, resolve_verifier,
)
from specheads.heads.export.consumers import check_consumers, consumer_problems, consumers_of
from specheads.heads.export.dspark import (
    BLOCK_LOADERS, BLOCK_TYPES, check_block_exportable, export_block_head, import_block_tensors,
)
from specheads.heads.export.formats import Format, register_format, register_variant
from specheads.heads.export.registry import BLOCK_FORMATS, detect_format, export_head, import_head, needs_target

__all__ = [
    "BLOCK_FORMATS", "BLOCK_LOADERS", "BLOCK_TYPES", "BUNDLED_TARGETS", "FORMATS", "Format", "HUB_IDS",
    "KIND_OF_FORMAT", "SPECULATIVE_TOKENS", "check_block_exportable",
    "check_consumers", "consumer_problems", "consumers_of", "detect_format", "export_block_head", "export_head",
    "import_block_tensors", "import_head", "legacy_rope_keys", "needs_target", "register_format", "register_variant",
    "resolve_verifier",
]


def __getattr__(name: str):
    """FORMATS and KIND_OF_FORMAT (export/registry.py): views of the format and kind registries, built on first use
    (the registries fill lazily)."""
    if name in ("FORMATS", "KIND_OF_FORMAT"):
        from specheads.heads.export import registry
        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
