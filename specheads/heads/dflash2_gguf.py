"""DFlash2 heads (heads/dflash2.py) as llama.cpp drafts: the DraftKind of the dflash2 KindSpec (heads/gguf.py runs
the export: our speculators folder, its config.json rewritten here, the pinned converter, the checks below).

    specheads export --head runs/x/final --format gguf --out runs/x/gguf
    llama-server -m target.gguf -md draft.gguf --spec-type draft-dflash --spec-draft-n-max K'

The converter reads DFlash2 only in z-lab's flat layout: `DFlashModel` (a Qwen3Model) is registered for
"DFlash2DraftModel" (conversion/qwen.py:664) and reads the Qwen3 keys at the top level plus `dflash_config`:
`mask_token_id` (:696-698), `block_size` (:710-711, default 16), the four keys conv_kernel_size, conv_group_size,
selector_rank, selector_top_k, written only when conv_kernel_size is present (:713-717), `target_layer_ids` stored
as hidden-states id - 1 and written + 1 (:735-738), `causal` (:749-753). Tensors keep z-lab's (= speculators' =
our) names, prefixed "model." (:826-833); the codebooks gain ".weight" (:852-856) and map to selector_predecessor /
selector_successor / selector_hidden, the convolutions to blk.{i}.attn_conv_base / attn_conv_proj / ffn_conv_base /
ffn_conv_proj (gguf-py tensor_mapping.py:1410-1436). base_kernel has no ".weight" suffix, so it stays F32 at every
outtype (conversion/base.py:1088-1119). So the config below is the speculators transformer_layer_config flattened,
with architectures ["DFlash2DraftModel"] and that dflash_config; the speculators keys are dropped.

What the runtime computes, checked equation by equation against heads/dflash2.py (vendor/llama.cpp file:line):
- the dynamic kernels κ = W_κ u from the normed sublayer input, laid out [T, side, tap, group] (ggml ne
  {G, k, 2, T}: src/models/dflash.cpp:436-438), b = base_kernel [side, tap, D] (ne {D, k, 2}: :254-257), weight
  b_t + δ_{i,t}[c // S] (group g holds channels g·S ... g·S + S - 1: :440-448), tap t reads slot i - t of the same
  block with zero padding before slot 0 (:453-471, ggml_pad_ext), taps past the block dropped (:451);
- the input side around attention (queries, keys, values of the block read the convolved norm; the context's
  keys come from the fused features unchanged: :708-713), the output side on the attention output before the
  residual (:747-749), the same around the MLP (:764-781); no post-norms (absent tensors);
- the selector on the final-normed state: C_j = top-k of the target-lm_head logits (:497-500; a logit scale or
  softcap applies only when the draft's config names one, :815-826, and ours names none, as our unary has none),
  W_h h (:501), the score U(v) + <P[prev] ⊙ W_h h, Q[v]> for every candidate v of slot j and every candidate prev
  of slot j - 1, the anchor (slot 0's token) for the first draft (:508-561); the CPU walk takes the argmax
  over C_j given the previous choice (common/speculative.cpp:1237-1262), i.e. our greedy walk. The block is
  [id_last, mask × n_max] (common/speculative.cpp:1205-1210 with --spec-type draft-dflash): slot 0 = the bonus
  token, which is head.sample_from_anchor false (true is refused).
Refused besides the dflash backbone's limits (heads/gguf.py dflash_backbone_problems): sample_from_anchor true; a
hidden size below k(k+1) (the lattice of k + k² scores is packed into one hidden-size row: src/models/dflash.cpp:149,
:495); a vocabulary past 2^24 (candidate ids travel as f32: :538). --spec-draft-p-min P cuts the block at the
first draft whose selector probability softmax(S_j over C_j) at the chosen token is below P
(common/speculative.cpp:1248-1256).
"""
from __future__ import annotations

from pathlib import Path

from specheads.heads.base import HeadConfig
from specheads.heads.export import check_block_exportable
from specheads.heads.export.dspark import block_layer_dict
from specheads.heads.gguf import DraftKind, _expect, _rope_theta, dflash_backbone_problems
from specheads.utils import SpecheadsError

ENGINE = "llama.cpp's DFlash2 draft (converter conversion/qwen.py DFlashModel, runtime src/models/dflash.cpp)"
OWN_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def check_head(cfg: HeadConfig, head_dir: Path) -> None:
    """What llama.cpp's DFlash2 graph cannot run, refused with the reason."""
    spec = cfg.head_spec
    check_block_exportable(cfg, "--format gguf", ENGINE, str(head_dir))
    problems = dflash_backbone_problems(cfg)
    if spec.options.sample_from_anchor:
        problems.append(f"{spec.key('sample_from_anchor')} is true, and llama.cpp's DFlash2 walk drafts from slot 1 "
                        "of a "
                        "block whose slot 0 is the bonus token (common/speculative.cpp:1205-1210, :1241)")
    k = spec.options.selector_top_k
    if cfg.hidden_size < k * (k + 1):
        problems.append(f"hidden size {cfg.hidden_size} < k(k+1) = {k * (k + 1)} for selector_top_k {k}: the "
                        "selector's k + k² scores are packed into one hidden-size row (src/models/dflash.cpp:149)")
    if cfg.vocab_size > 2 ** 24:
        problems.append(f"vocabulary {cfg.vocab_size} > 2^24: candidate ids travel as f32 "
                        "(src/models/dflash.cpp:538, common/speculative.cpp:1256)")
    if problems:
        raise SpecheadsError(f"--format gguf: {head_dir}: {ENGINE} cannot run this head: " + "; ".join(problems))


def converter_config(cfg: HeadConfig, config: dict) -> dict:
    """z-lab's flat DFlash2DraftModel config.json: the Qwen3 layer keys at the top level and dflash_config with
    every key DFlashModel reads (the exported speculators config is replaced, not extended)."""
    spec = cfg.head_spec
    flat = block_layer_dict(cfg)
    flat.pop("is_causal", None)  # causal comes from dflash_config (conversion/qwen.py:749-753)
    flat.update(architectures=["DFlash2DraftModel"], block_size=spec.options.block_size,
                dflash_config={"block_size": spec.options.block_size, "mask_token_id": spec.mask_token_id,
                               "target_layer_ids": [i - 1 for i in cfg.feature_layers], "causal": False,
                               **{k: int(getattr(spec.options, k)) for k in OWN_KEYS}})
    return flat


def check_gguf(cfg: HeadConfig, meta: dict, tensors: dict, path: Path) -> None:
    """The converted draft: the dflash conventions, the four DFlash2 keys, and every convolution / selector tensor
    in the shape src/models/dflash.cpp:153-155, :254-257 load (ggml order: torch's reversed)."""
    spec, D, V = cfg.head_spec, cfg.hidden_size, cfg.vocab_size
    for key, want in [("general.architecture", "dflash"), ("dflash.target_layers", list(cfg.feature_layers)),
                      ("dflash.block_size", spec.options.block_size), ("dflash.attention.causal", False),
                      ("tokenizer.ggml.mask_token_id", spec.mask_token_id), ("dflash.block_count", spec.num_layers),
                      ("dflash.embedding_length", D),
                      *((f"dflash.{k}", int(getattr(spec.options, k))) for k in OWN_KEYS)]:
        _expect(meta, key, want, path)
    _expect(meta, "dflash.rope.freq_base", _rope_theta(cfg), path, close=True)
    _expect(meta, "dflash.attention.layer_norm_rms_epsilon", float(cfg.target_config["rms_norm_eps"]), path,
            close=True)
    k, G, r = spec.options.conv_kernel_size, D // spec.options.conv_group_size, spec.options.selector_rank
    shapes = {"fc.weight": None, "enc.output_norm.weight": None, "output_norm.weight": None,
              "selector_predecessor.weight": (r, V), "selector_successor.weight": (r, V),
              "selector_hidden.weight": (D, r)}
    for i in range(spec.num_layers):
        for side in ("attn", "ffn"):
            shapes[f"blk.{i}.{side}_conv_base"] = (D, k, 2)
            shapes[f"blk.{i}.{side}_conv_proj.weight"] = (D, 2 * k * G)
    for name, shape in shapes.items():
        if name not in tensors:
            raise SpecheadsError(f"{path}: tensor {name!r} missing from the converted draft")
        if shape is not None and tuple(int(n) for n in tensors[name].shape) != shape:
            raise SpecheadsError(f"{path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, llama.cpp "
                                 f"loads {shape}")
    for name in ("output.weight", "markov_w1.weight", "conf_proj.weight"):
        if name in tensors:  # the target's lm_head is the unary; no DSpark head rides along
            raise SpecheadsError(f"{path}: the converted DFlash2 draft carries {name!r}")


def notes(cfg: HeadConfig, head_dir: Path) -> dict:
    spec = cfg.head_spec
    return {"server_args": ["--spec-draft-n-max", str(spec.num_drafts)],
            "block": f"--spec-draft-n-max {spec.num_drafts} runs the block as trained "
                     f"({spec.options.block_size} slots, "
                     "slot 0 the bonus token); a smaller N decodes a shorter block, whose bidirectional attention "
                     "differs from training",
            "p_min": "--spec-draft-p-min P cuts the block at the first draft whose selector probability "
                     "(softmax of S over the k candidates, at the chosen token) is below P"}


DFLASH2_DRAFT = DraftKind("speculators", "draft-dflash", "dflash", check_head, converter_config, check_gguf, notes,
                          marker="dflash.selector_top_k")
