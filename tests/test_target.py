"""Target loading: facts read from the model, the GGUF conversion cache, clear errors."""
import pytest
import torch

from specheads.target import load_target, target_fingerprint
from specheads.utils import SpecheadsError


def test_tiny_target_facts(tiny):
    assert tiny.hidden_size == 64 and tiny.num_layers == 4 and tiny.vocab_size == 256
    assert tiny.embed_tokens.weight.data_ptr() != tiny.lm_head.weight.data_ptr()  # untied
    assert not any(p.requires_grad for p in tiny.model.parameters())
    ids = torch.randint(0, 256, (1, 7))
    out = tiny.model(ids, output_hidden_states=True)
    # The last hidden state is post-norm: the lm_head input (the convention in docs/architecture.md).
    torch.testing.assert_close(tiny.lm_head(out.hidden_states[-1]), out.logits)
    torch.testing.assert_close(tiny.base(ids).last_hidden_state, out.hidden_states[-1])


def test_fingerprint_tracks_weights(tiny):
    fp = tiny.fingerprint()
    assert fp == target_fingerprint(tiny.embed_tokens.weight.to(torch.bfloat16), tiny.lm_head.weight)
    w = tiny.lm_head.weight.clone()
    w[0] += 1.0
    assert target_fingerprint(tiny.embed_tokens.weight, w)["lm_head_hash"] != fp["lm_head_hash"]


def test_bad_paths(tmp_path):
    with pytest.raises(SpecheadsError, match="GGUF file not found"):
        load_target(str(tmp_path / "missing.gguf"))
    with pytest.raises(SpecheadsError, match="no config.json"):
        load_target(str(tmp_path))
    with pytest.raises(SpecheadsError, match="dtype"):
        load_target("smollm2-135m", dtype="int3")


@pytest.mark.slow
def test_smollm2_from_cache(smollm2):
    t = smollm2
    assert (t.hidden_size, t.num_layers, t.vocab_size) == (576, 30, 49152)
    assert t.embed_tokens.weight.data_ptr() == t.lm_head.weight.data_ptr() and t.eos_token_ids[0] == 2  # tied
    assert t.tokenizer.chat_template and "<|im_start|>" in t.tokenizer.chat_template
    again = load_target("smollm2-135m", dtype="bfloat16")  # from the converted cache: no GGUF parse
    assert again.dtype == torch.bfloat16
    assert again.fingerprint() == t.fingerprint()


def _small_gguf(path):
    """A small whole GGUF file (llama metadata, one 64x16 tensor), as llama.cpp's gguf package writes it."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.arange(64 * 16, dtype=np.float32).reshape(64, 16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


@pytest.mark.parametrize("cut, want", [
    (0, r"not a GGUF file: an empty file \(0 bytes\)"),
    ("text", r"not a GGUF file: does not start with the GGUF magic bytes \(b'hell'\)"),
    (100, r"not a readable GGUF file, truncated or damaged \(100 bytes; "),
    (-64, r"not a readable GGUF file, truncated or damaged \(\d+ bytes; ValueError: cannot reshape"),
])
def test_a_gguf_target_that_is_empty_cut_or_not_gguf_is_one_line(tmp_path, monkeypatch, cut, want):
    """issue 38: such files reached transformers' GGUF reader and ended in its ValueError / struct.error."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    whole = _small_gguf(tmp_path / "whole.gguf")
    bad = tmp_path / "t.gguf"
    bad.write_bytes(b"hello world\n" if cut == "text" else whole[:cut])
    with pytest.raises(SpecheadsError, match=rf"^{bad}: {want}") as e:
        load_target(str(bad))
    assert "\n" not in str(e.value) and not (tmp_path / "cache").exists()


def test_check_gguf_takes_a_whole_file(tmp_path):
    from specheads.target import check_gguf

    _small_gguf(tmp_path / "whole.gguf")
    check_gguf(tmp_path / "whole.gguf")


def test_a_target_whose_model_type_transformers_does_not_know_is_one_line(tmp_path):
    """issue 38: an unknown model_type ended in transformers' ValueError; now refused before transformers reads the
    folder, naming the file and the type."""
    import json

    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "frobnicator", "hidden_size": 8}))
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(SpecheadsError, match=rf"^target '{folder}': {folder / 'config.json'} has model_type "
                                             r"'frobnicator', which transformers [\d.]+ does not know"):
        load_target(str(folder))
