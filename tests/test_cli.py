"""The CLI is thin: every command is registered and user mistakes print one line, exit 2, no traceback."""
import subprocess
import sys
from pathlib import Path

from specheads.cli import COMMANDS, build_parser, main


def test_all_commands_registered():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(COMMANDS) <= set(sub.choices)


def test_user_error_is_one_line(tmp_path, capsys):
    bad = tmp_path / "nope.yaml"
    rc = main(["prepare", "--config", str(bad)])
    err = capsys.readouterr().err
    assert rc == 2
    assert "nope.yaml" in err and "Traceback" not in err


def test_calibrate_only_refuses_what_it_cannot_calibrate(tmp_path, capsys):
    """`train --calibrate-only`: with --resume, on a head without a confidence head, on a run with no trained head:
    one line each, exit 2, nothing written."""
    configs = Path(__file__).resolve().parents[1] / "configs"
    eagle = ["train", "--config", str(configs / "eagle3-smollm2.yaml"), f"output_dir={tmp_path}"]
    dspark = ["train", "--config", str(configs / "dspark-smollm2.yaml"), f"output_dir={tmp_path}"]
    for argv, line in ((eagle + ["--calibrate-only", "--resume"], "choose one"),
                       (eagle + ["--calibrate-only"], "has no confidence head"),
                       (dspark + ["--calibrate-only"], "has no trained head")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert line in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "specheads", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and "specheads" in out.stdout


# ------------------------------------------------------------------------------------ bad flags: one line, exit 2
import pytest  # noqa: E402


@pytest.fixture
def heads(tiny, tmp_path, monkeypatch):
    """Head folders for the tiny target, and a load_target that fails the test: every bad flag below is refused
    before any model loads."""
    import specheads.target
    from specheads.heads.base import HeadSpec, build_head

    for kind in ("eagle3", "medusa"):
        build_head(HeadSpec(kind=kind, **({"num_heads": 3} if kind == "medusa" else {})), tiny).save_pretrained(tmp_path / kind)

    def no_load(*a, **k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(specheads.target, "load_target", no_load)
    return {k: str(tmp_path / k) for k in ("eagle3", "medusa")}


GENERATE_BAD = [  # (extra flags, head kind or None, what the one line says)
    (["--tree", "3,100000,10"], "eagle3", "--tree 3,100000,10: TOP_K 100000 is above the head's draft vocabulary"),
    (["--tree", "0,0,0"], "eagle3", "--tree 0,0,0: DEPTH 0 is outside 1..64; an EAGLE-3 head takes DEPTH,TOP_K"),
    (["--tree=-1,8,48"], "eagle3", "--tree -1,8,48: DEPTH -1"),  # argparse reads a leading "-1," as a flag
    (["--tree", "3,0,10"], "eagle3", "--tree 3,0,10: TOP_K 0 must be at least 1"),
    (["--tree", "chain:0"], "medusa", "--tree chain:0: the chain length K 0 is outside 1..64; a Medusa head takes"),
    (["--tree", "chain:x"], "medusa", "--tree chain:x: expected chain:K with K a whole number"),
    (["--tree", "[[100000]]"], "medusa", "--tree [[100000]]: rank 100000 is beyond the head's draft vocabulary"),
    (["--tree", "0"], None, "--tree 0: the number of draft tokens 0 is outside 1..64; prompt-lookup takes"),
    (["--tree", "-3"], None, "--tree -3: the number of draft tokens -3 is outside 1..64; prompt-lookup takes"),
    (["--drafter", "draft-model", "--tree", "0"], None, "--tree 0: the number of draft tokens 0 is outside 1..64; draft-model takes"),
    (["--drafter", "plain", "--tree", "4"], None, "--tree 4: plain decoding drafts nothing"),
    (["--lookup", "-4"], "eagle3", "--lookup -4: must be 0 (off) .. 64"),
    (["--drafter", "draft-model", "--draft-model", "truncated:0"], None, "--draft-model truncated:0: must be at least 1"),
    (["--temperature", "nan"], None, "--temperature nan: must be a finite number"),
    (["--temperature", "inf"], None, "--temperature inf: must be a finite number"),
    (["--top-p", "nan"], None, "--top-p nan: must be a finite number"),
    (["--top-k", "-1"], None, "--top-k -1: must be >= 0"),
    (["--tree", "auto"], None, "--tree auto: needs --head"),
]


@pytest.mark.parametrize("flags,kind,line", GENERATE_BAD, ids=[" ".join(f) + f" ({k})" for f, k, _ in GENERATE_BAD])
def test_generate_bad_flags(heads, capsys, flags, kind, line):
    argv = ["generate", "--prompt", "Hi"] + (["--head", heads[kind]] if kind else []) + flags
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert line in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


BENCH_BAD = [
    (["--tree", "3,100000,10"], "eagle3", "--tree 3,100000,10: TOP_K 100000 is above the head's draft vocabulary"),
    (["--tree", "[[0],[0,0]]x"], "medusa", "a Medusa head takes chain:K"),
    (["--tree", "2,4,8"], "medusa", "--tree 2,4,8: not a tree spec; a Medusa head takes"),
    (["--temperature", "nan"], "eagle3", "--temperature nan: must be a finite number"),
    (["--lookup", "0"], "eagle3", "--lookup 0: must be 1..64"),
    (["--tree", "nope=2"], "eagle3", "--tree nope=2: 'nope' is not a --head label (labels: ['head'])"),
    (["--tree", "head=2,4,8", "--tree", "medusa=3"], "medusa", "--tree medusa=3: 'medusa' is not a --head label"),
]


@pytest.mark.parametrize("flags,kind,line", BENCH_BAD, ids=[" ".join(f) + f" ({k})" for f, k, _ in BENCH_BAD])
def test_bench_bad_flags(heads, tmp_path, capsys, flags, kind, line):
    argv = ["bench", "--head", heads[kind], "--methods", "vanilla,head", "--out", str(tmp_path / "b")] + flags
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert line in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


OLD_SPELLINGS = [  # (command, old flags, the notice, what the flags now hold)
    ("bench", ["--head-lookup", "3"], "--head-lookup is now --lookup", {"lookup": 3}),
    ("generate", ["--draft-layers", "2"], "--draft-layers is now --draft-model truncated:2",
     {"draft_model": "truncated:2"}),
    ("generate", ["--draft-target", "m"], "--draft-target is now --draft-model", {"draft_model": "m"}),
    ("bench", ["--draft-tokens", "3"], "--draft-tokens is now --tree draft-model=3", {"tree": ["draft-model=3"]}),
    ("eval", ["--tree-width", "3"], "--tree-width is now --tree DEPTH,TOP_K", {"tree_width": 3, "tree": None}),
]


@pytest.mark.parametrize("command,flags,notice,values", OLD_SPELLINGS, ids=[f[0] for _, f, _, _ in OLD_SPELLINGS])
def test_old_spellings_still_work_with_a_one_line_notice(capsys, command, flags, notice, values):
    required = {"bench": ["--out", "x"], "generate": ["--prompt", "hi"], "eval": ["--head", "h"]}[command]
    args = build_parser().parse_args([command] + required + flags)
    assert {k: getattr(args, k) for k in values} == values
    err = capsys.readouterr().err
    assert notice in err and len(err.strip().splitlines()) == 1, err
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert flags[0] not in sub.choices[command].format_help()  # hidden from --help


def test_old_spelling_in_an_error_names_the_flag_as_typed(heads, capsys):
    assert main(["generate", "--prompt", "Hi", "--drafter", "draft-model", "--draft-layers", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--draft-layers is now" in err[0]
    assert "--draft-layers 0: must be at least 1" in err[1]


def test_one_dtype_default_and_spelling():
    """One --dtype table (utils.DTYPE_NAMES) in every command; eval's default stays the recipes' bf16 (None: the
    run's for heldout:RUN)."""
    from specheads.commands.args import dtype_name

    parser = build_parser()
    commands = (("bench", ["--out", "x"], "float32"), ("generate", ["--prompt", "hi"], "float32"),
                ("export", ["--head", "h", "--format", "eagle", "--out", "o"], "float32"), ("eval", ["--head", "h"], None))
    for command, required, default in commands:
        assert parser.parse_args([command] + required).dtype == default, command
        for flag in ("bf16", "bfloat16", "fp32", "float32", "fp16", "float16"):
            assert parser.parse_args([command] + required + ["--dtype", flag]).dtype == flag
    assert [dtype_name(f) for f in ("bf16", "fp32", "fp16")] == ["bfloat16", "float32", "float16"]


def test_one_tree_flag_for_the_draft_model_chain_and_evals_tree(capsys):
    """bench's draft-model chain is `--tree draft-model=N` (generate: --tree N), eval's simulated tree `--tree
    DEPTH,TOP_K`; the old spellings land in the same values."""
    from specheads.commands.args import eval_tree
    from specheads.commands.bench import method_options
    from specheads.utils import SpecheadsError

    parser = build_parser()
    new = method_options(parser.parse_args(["bench", "--out", "x", "--tree", "draft-model=6"]))
    old = method_options(parser.parse_args(["bench", "--out", "x", "--draft-tokens", "6"]))
    assert new.draft_tokens == old.draft_tokens == 6
    assert method_options(parser.parse_args(["bench", "--out", "x"])).draft_tokens == 4
    assert eval_tree(parser.parse_args(["eval", "--head", "h", "--tree", "5,3"])) == (5, 3)
    assert eval_tree(parser.parse_args(["eval", "--head", "h", "--tree-depth", "5", "--tree-width", "3"])) == (5, 3)
    assert eval_tree(parser.parse_args(["eval", "--head", "h"])) == (4, 2)
    with pytest.raises(SpecheadsError, match="expected DEPTH,TOP_K"):
        eval_tree(parser.parse_args(["eval", "--head", "h", "--tree", "5,3,9"]))


def test_one_pricing_flag_for_generate_and_bench():
    """--pricing: one spelling and default (measured) in generate and bench; bench hands it to the methods."""
    from specheads.commands.bench import method_options

    parser = build_parser()
    for command, required in (("bench", ["--out", "x"]), ("generate", ["--prompt", "hi"])):
        assert parser.parse_args([command] + required).pricing == "measured"
        assert parser.parse_args([command] + required + ["--pricing", "profile"]).pricing == "profile"
    assert method_options(parser.parse_args(["bench", "--out", "x", "--pricing", "profile"])).pricing == "profile"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--out", "x", "--pricing", "wallclock"])


def test_llamacpp_threads_default_to_the_cores_this_process_may_use():
    import os

    from specheads.infer.bench.llamacpp import default_threads

    assert default_threads() == len(os.sched_getaffinity(0))


def test_draft_layers_beyond_the_target_is_one_clear_error(tiny):
    from specheads.infer.drafters import build_drafter, truncated_draft_model
    from specheads.utils import SpecheadsError

    assert len(truncated_draft_model(tiny, 3).model.layers) == 3
    for n in (0, 4, -1):  # the tiny target has 4 layers: a draft keeps 1..3
        with pytest.raises(SpecheadsError, match=f"--draft-model truncated:{n}: must be 1..3"):
            build_drafter(tiny, "draft-model", "2", draft_layers=n)
