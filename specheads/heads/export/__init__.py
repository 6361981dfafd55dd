"""Export a native head folder to the layouts serving engines read, and import those layouts (and the original
research repos' checkpoints) back. Safetensors only: nothing here unpickles a file. docs/exports.md cites each
consumer's loader (repository, commit, path) and says what was run and what only read.

One module per format family, each naming the loaders it matches:
- registry.py: the formats, `export_head` / `import_head` and layout detection; native is our own format
  (HeadConfig and our state dict);
- consumers.py: the consumers of each format (the names `--consumer` takes) and what each cannot read
  (`consumer_problems`), refused naming the consumer and the reason;
- eagle.py: EAGLE-1, `eagle` (SGLang, the EAGLE repo) and `eagle-vllm` (vLLM);
- eagle3.py: EAGLE-3, `eagle3` (SGLang, vLLM, llama.cpp; the EAGLE-3 repo opt-in);
- speculators.py: EAGLE-3, `speculators` (speculators, and vLLM through it);
- dspark.py: DSpark / DFlash block heads, `speculators` (dspark / dflash) and `specforge` (SpecForge, SGLang);
- domino.py: Domino's SpecForge keys on that block export (its KindSpec.exporter);
- medusa.py: `medusa-vllm` (vLLM);
- repos.py: FasterDecoding Medusa checkpoints (EAGLE repo folders have the eagle / eagle3 layouts);
- common.py: what several loaders read alike (rope_theta, d2t offsets, the verifier's name).
Every non-native EAGLE / Medusa export also carries a `specheads` block: format, consumers checked, verifier,
feature layers. `--format gguf` is heads/gguf.py, which runs llama.cpp's converter on an export from here.
"""
from specheads.heads.export.common import (
    BUNDLED_TARGETS, HUB_IDS, SPECULATIVE_TOKENS, legacy_rope_keys, resolve_verifier,
)
from specheads.heads.export.consumers import LOADERS, OPT_IN, check_consumers, consumer_problems, consumers_of
from specheads.heads.export.dspark import (
    BLOCK_LOADERS, BLOCK_TYPES, check_block_exportable, export_block_head, import_block_tensors,
)
from specheads.heads.export.registry import (
    BLOCK_FORMATS, FORMATS, READERS, WRITERS, detect_format, export_head, import_head, needs_target,
)

__all__ = [
    "BLOCK_FORMATS", "BLOCK_LOADERS", "BLOCK_TYPES", "BUNDLED_TARGETS", "FORMATS", "HUB_IDS", "KIND_OF_FORMAT",
    "LOADERS", "OPT_IN", "READERS", "SPECULATIVE_TOKENS", "WRITERS", "check_block_exportable", "check_consumers",
    "consumer_problems", "consumers_of", "detect_format", "export_block_head", "export_head", "import_block_tensors",
    "import_head", "legacy_rope_keys", "needs_target", "resolve_verifier",
]


def __getattr__(name: str):
    """KIND_OF_FORMAT: a view of the kind registry (export/registry.py), kept for importers."""
    if name == "KIND_OF_FORMAT":
        from specheads.heads.export import registry
        return registry.KIND_OF_FORMAT
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
