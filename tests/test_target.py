"""Target loading: facts read from the model, the GGUF conversion cache, clear errors."""
import pytest
import torch

from specheads.target import load_target, target_fingerprint
from specheads.utils import SpecheadsError


def test_tiny_target_facts(tiny):
    assert tiny.hidden_size == 64 and tiny.num_layers == 4 and tiny.vocab_size == 256
    assert not tiny.tied_embeddings
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
    assert t.tied_embeddings and t.eos_token_ids[0] == 2
    assert t.tokenizer.chat_template and "<|im_start|>" in t.tokenizer.chat_template
    again = load_target("smollm2-135m", dtype="bfloat16")  # from the converted cache: no GGUF parse
    assert again.dtype == torch.bfloat16
    assert again.fingerprint() == t.fingerprint()
