"""The owned forward (infer/engine/owned.py) and its runner: the same numbers as the HF forward on every family it
claims (fp32: logits and hidden states to rounding noise, over a cache and a tree), greedy output identical to HF
generate, a clear refusal or fallback elsewhere, and the prefill computing logits only for a drafter that reads them.
The compiled bf16 kernels (infer/engine/kernels.py) are checked against PyTorch where this CPU has AVX512-BF16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specheads.infer.drafters import build_drafter
from specheads.infer.engine import kernels
from specheads.infer.engine.generate import generate
from specheads.infer.engine.owned import owned_reason
from specheads.infer.engine.runner import HFRunner, OwnedRunner, runner_for
from specheads.infer.engine.protocol import Drafter
from specheads.infer.tree import tree_from_parents
from specheads.target import Target, tiny_gemma3_target, tiny_target
from specheads.utils import SpecheadsError


def tiny_family(kind: str, dtype=torch.float32) -> Target:
    """A random 3-layer target of one owned family (qwen2: q/k/v biases; qwen3: per-head q/k norms)."""
    if kind == "llama":
        return tiny_target(num_layers=3, dtype=dtype, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5,
                           "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64})
    import transformers

    cfg_cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
               "mistral": transformers.MistralConfig}[kind]
    model_cls = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
                 "mistral": transformers.MistralForCausalLM}[kind]
    torch.manual_seed(0)
    cfg = cfg_cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                  sliding_window=None, use_sliding_window=False)
    cfg._attn_implementation = "sdpa"
    model = model_cls(cfg).to(dtype).eval().requires_grad_(False)
    if kind == "qwen2":  # random biases: zeros would hide a missing bias add
        for layer in model.model.layers:
            for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                m.bias.data.normal_(0, 0.5)
    return Target(model=model, tokenizer=None, name=f"tiny-{kind}")


def hf_logits(target, ids, layers):
    out = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0], torch.cat([out.hidden_states[l][0] for l in layers], -1)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_owned_forward_equals_hf_over_a_cache_and_a_tree(kind):
    """Prefill, then a tree (two branches) over the cache: every node's logits and features are what the HF forward
    gives the same tokens as one causal sequence along that node's path."""
    t = tiny_family(kind)
    assert owned_reason(t.model) == ""
    r = OwnedRunner(t)
    prompt, layers = [5, 9, 17, 33, 2, 71, 8], [0, 2, 3]
    r.reset(4)  # smaller than needed: the cache grows
    logits, feats = r.forward(torch.tensor(prompt), None, layers)
    ref_logits, ref_feats = hf_logits(t, prompt, layers)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(feats, ref_feats, rtol=1e-5, atol=1e-5)
    r.keep(len(prompt), range(len(prompt)))
    tree = tree_from_parents([40, 41, 42, 43, 44], [-1, 0, 1, 0, 3])  # root -> 41 -> 42; root -> 43 -> 44
    logits, feats = r.forward(tree.tokens, r.tree_inputs(tree), layers)
    for node in range(len(tree)):
        path = prompt + [int(tree.tokens[i]) for i in tree.path(node)]
        ref_logits, ref_feats = hf_logits(t, path, layers)
        torch.testing.assert_close(logits[node], ref_logits[-1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(feats[node], ref_feats[-1], rtol=1e-5, atol=1e-5)
    r.keep(len(tree), [0, 3, 4])  # the second branch accepted: its entries move down
    assert r.length == len(prompt) + 3
    logits, _ = r.forward(torch.tensor([7]), None)
    torch.testing.assert_close(logits[0], hf_logits(t, prompt + [40, 43, 44, 7], layers)[0][-1], rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_generation_is_identical_on_both_engines(kind):
    """fp32 greedy: plain and a prompt-lookup chain on the owned engine write exactly what HF generate writes."""
    t = tiny_family(kind)
    prompt = [5, 6, 7, 8, 9, 10] * 3
    ref = t.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0)[0, 18:]
    for engine in ("owned", "hf"):
        t.engine = engine
        assert runner_for(t).name == engine
        for drafter in (None, build_drafter(t, "prompt-lookup", "6")):
            assert generate(t, drafter, prompt, max_new_tokens=24, ignore_eos=True).ids == ref.tolist()


def test_unsupported_architectures_fall_back_or_are_refused():
    """Gemma 3 (sliding windows, its own norms): auto runs the HF forward; --engine owned says why it cannot."""
    t = tiny_gemma3_target()
    assert "gemma3" in owned_reason(t.model)
    assert isinstance(runner_for(t), HFRunner)
    t.engine = "owned"
    with pytest.raises(SpecheadsError, match="--engine owned: target .* cannot run the owned forward: model_type"):
        runner_for(t)
    t.engine = "fast"
    with pytest.raises(SpecheadsError, match="--engine 'fast': expected one of auto, owned, hf"):
        runner_for(t)


def test_adapters_keep_the_hf_forward():
    """A projection wrapped by an adapter (or hooked) is not a plain Linear: the owned forward would skip it."""
    t = tiny_target(num_layers=2)
    t.model.model.layers[1].mlp.down_proj.register_forward_hook(lambda *a: None)
    assert "not a plain Linear" in owned_reason(t.model)


class Recorder(Drafter):
    def __init__(self, reads: bool):
        self.reads_logits, self.seen = reads, []

    def recycle(self, tokens, logits):
        self.seen.append(logits.shape[0])


@pytest.mark.parametrize("engine", ["owned", "hf"])
def test_prefill_computes_logits_only_for_a_drafter_that_reads_them(engine):
    t = tiny_target()
    t.engine = engine
    prompt = list(range(3, 40))
    for reads in (False, True):
        d = Recorder(reads)
        generate(t, d, prompt, max_new_tokens=3, ignore_eos=True)
        # the prompt's rows reach recycle only when asked for; every step's tree (one node here) always does
        assert d.seen == ([len(prompt) - 1] if reads else []) + [1, 1, 1]


needs_kernels = pytest.mark.skipif(kernels.bf16_ops() is None, reason="no AVX512-BF16 or no compiler here")


@needs_kernels
def test_bf16_linear_matches_pytorch_and_does_not_depend_on_the_rows():
    ops = kernels.bf16_ops()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(203, 96, generator=g).bfloat16()
    x = torch.randn(13, 96, generator=g).bfloat16()
    y = ops.linear_bf16(x, w)
    ref = x.float() @ w.float().t()
    assert ((y.float() - ref).abs() <= 0.01 * ref.abs() + 0.02).all()
    for m in (1, 2, 5, 8):  # the same row alone or among others: bit for bit
        assert torch.equal(ops.linear_bf16(x[:m], w), y[:m])


@needs_kernels
def test_packed_linear_matches_pytorch_and_does_not_depend_on_the_rows():
    """The decode path's packed layout (blocks of 64 output rows; 203 leaves a partial one), any row count."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(203, 96, generator=g).bfloat16()
    x = torch.randn(13, 96, generator=g).bfloat16()
    wp = kernels.packed(w)
    assert wp is not None and kernels.packed(w) is wp  # made once
    y = kernels.bf16_ops().linear_packed_bf16(x, wp, 203)
    ref = x.float() @ w.float().t()
    assert ((y.float() - ref).abs() <= 0.01 * ref.abs() + 0.02).all()
    for m in (1, 2, 3, 4, 5, 8):
        assert torch.equal(kernels.bf16_ops().linear_packed_bf16(x[:m], wp, 203), y[:m])
    assert torch.equal(kernels.linear(x[:3], w), y[:3])  # a served head's projections take the same path
    big = torch.randn(1100, 64, generator=g).bfloat16()  # 1024 rows and more: blocks of 64 (one partial)
    bp = kernels.packed(big)
    assert bp.shape[2] == 64 and wp.shape[2] == 32
    y = kernels.bf16_ops().linear_packed_bf16(x[:, :64].contiguous(), bp, 1100)
    ref = x[:, :64].float() @ big.float().t()
    assert ((y.float() - ref).abs() <= 0.01 * ref.abs() + 0.02).all()
    for m in (1, 4, 5, 9):
        assert torch.equal(kernels.bf16_ops().linear_packed_bf16(x[:m, :64].contiguous(), bp, 1100), y[:m])


@needs_kernels
def test_a_packed_copy_belongs_to_its_weight_not_its_address():
    """A weight freed and another made in its place (often at the same address, as a test's next tiny target is)
    never reuses the first one's packed copy; a weight changed in place is packed again; a freed one's copy goes."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 64, generator=g).bfloat16()
    ops = kernels.bf16_ops()
    for _ in range(6):
        w = torch.randn(96, 64, generator=g).bfloat16()
        assert torch.equal(kernels.linear(x, w), ops.linear_packed_bf16(x, ops.pack_bf16(w), 96))
        key = id(w)
        del w
        assert key not in kernels._PACKED
    w = torch.randn(96, 64, generator=g).bfloat16()
    first = kernels.linear(x, w)
    w.mul_(2)
    assert torch.equal(kernels.linear(x, w), ops.linear_packed_bf16(x, ops.pack_bf16(w), 96))
    assert not torch.equal(kernels.linear(x, w), first)


@needs_kernels
def test_compiled_attention_matches_pytorch():
    ops = kernels.bf16_ops()
    g = torch.Generator().manual_seed(1)
    kc, vc = torch.randn(2, 64, 32, generator=g), torch.randn(2, 64, 32, generator=g)
    for n, S in ((1, 40), (5, 37)):
        q = torch.randn(4, n, 32, generator=g)
        allowed = torch.rand(n, S, generator=g) > 0.3
        allowed[:, 0] = True
        for mask in ((None,) if n == 1 else (allowed,)):
            ref = F.scaled_dot_product_attention(q[None], kc[:, :S][None], vc[:, :S][None], attn_mask=mask,
                                                 scale=32 ** -0.5, enable_gqa=True)[0].transpose(0, 1).reshape(n, -1)
            out = ops.attend_bf16(q, kc, vc, S, mask, 32 ** -0.5).float()
            torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)


@needs_kernels
def test_bf16_owned_forward_tracks_hf_bf16():
    """bf16 is not bit-exact with HF's (other kernels round otherwise), but the logits agree to bf16 noise."""
    t = tiny_target(num_layers=3, hidden_size=64, dtype=torch.bfloat16)
    r = OwnedRunner(t)
    assert r.model.fused
    prompt = [5, 9, 17, 33, 2, 71, 8, 90, 14]
    r.reset(16)
    r.forward(torch.tensor(prompt[:-1]), None, logit_rows="none")
    r.keep(len(prompt) - 1, range(len(prompt) - 1))
    logits, _ = r.forward(torch.tensor(prompt[-1:]), None)
    ref = t.model(input_ids=torch.tensor([prompt])).logits[0, -1]
    assert (logits[0].float() - ref.float()).abs().max() < 0.05 * ref.float().abs().max()


@needs_kernels
def test_a_long_bf16_prefill_attends_with_sdpa_and_tracks_hf():
    """A prefill of more than PREFILL_ROWS tokens (after an earlier turn) attends with PyTorch's SDPA instead of
    the one-by-one kernel: its last logits and the next step's agree with HF's bf16 forward to bf16 noise."""
    from specheads.infer.engine.owned import PREFILL_ROWS

    t = tiny_target(num_layers=3, hidden_size=64, dtype=torch.bfloat16)
    r = OwnedRunner(t)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, t.vocab_size, (2 * PREFILL_ROWS + 7,), generator=g).tolist()
    r.reset(len(prompt) + 8)
    r.forward(torch.tensor(prompt[:5]), None, logit_rows="none")  # an earlier turn: the long prefill starts at 5
    r.keep(5, range(5))
    logits, _ = r.forward(torch.tensor(prompt[5:-1]), None, logit_rows="last")
    r.keep(len(prompt) - 6, range(len(prompt) - 6))
    step, _ = r.forward(torch.tensor(prompt[-1:]), None)
    ref = t.model(input_ids=torch.tensor([prompt])).logits[0]
    for got, want in ((logits[0], ref[-2]), (step[0], ref[-1])):
        assert (got.float() - want.float()).abs().max() < 0.05 * want.float().abs().max()


@needs_kernels
def test_one_call_stack_gives_the_layer_loops_numbers():
    """kernels.stack_bf16 (every layer in one compiled call) runs the per-layer loop's ops in its order: the logits
    and the hidden states a head reads are the same bits, over a cache, for one row and for a tree."""
    t = tiny_target(num_layers=3, hidden_size=64, dtype=torch.bfloat16)
    m = OwnedRunner(t).model
    assert m._flat is not None
    flat, prompt = m._flat, torch.tensor([5, 9, 17, 33, 2, 71, 8, 90, 14])
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)  # a root, two children, a grandchild

    def run(one_call: bool, n: int):
        m._flat = flat if one_call else None
        m.reset(32)
        first, _ = m.forward(prompt, torch.arange(9), None, layers=[1, 2], logit_rows="all")
        m.length = 9
        step, feats = m.forward(torch.tensor([3, 4, 6, 7][:n]), torch.tensor([9, 10, 10, 11][:n]),
                                tree[:n, :n] if n > 1 else None, layers=[1, 2, 3])
        return first, step, feats

    for n in (1, 4):
        for a, b in zip(run(True, n), run(False, n)):
            assert torch.equal(a, b)


@needs_kernels
def test_a_served_head_beside_a_bf16_target_runs_on_the_kernel():
    """resolve.serve_head: a head saved in fp32 serves in the bf16 target's dtype, its own projections on the
    kernel (KernelLinear, same parameters) and the frozen target projection through kernels.linear; its logits are
    the bf16 head's to bf16 noise. An fp32 target keeps the head as it is."""
    import copy

    from specheads.heads.base import HeadSpec, build_head
    from specheads.infer.resolve import serve_head

    t = tiny_target(num_layers=4, hidden_size=64, dtype=torch.bfloat16)
    head = build_head(HeadSpec(kind="eagle3", draft_vocab_size=64), t).eval()
    ref = copy.deepcopy(head).to(torch.bfloat16)
    served = serve_head(head, t)
    assert served.head_dtype == torch.bfloat16 and served.linear is kernels.linear
    assert sum(type(m) is kernels.KernelLinear for m in served.modules()) >= 4
    g = torch.Generator().manual_seed(0)
    feats, tokens = torch.randn(1, 6, 3 * 64, generator=g).bfloat16(), torch.randint(0, 256, (1, 6), generator=g)
    with torch.no_grad():
        a, b = ref(feats, tokens, steps=1)[0].float(), served(feats, tokens, steps=1)[0].float()
    assert (a - b).abs().max() <= 0.05 * a.abs().max()
    t32 = tiny_target(num_layers=4, hidden_size=64)
    h32 = serve_head(build_head(HeadSpec(kind="eagle3", draft_vocab_size=64), t32).eval(), t32)
    assert h32.head_dtype == torch.float32 and not any(type(m) is kernels.KernelLinear for m in h32.modules())
