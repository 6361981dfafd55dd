"""The CUDA-graph step (engine/graphs.py) in its static form: padded buckets, the whole-capacity mask and the
cache written by index_copy_. On a CPU the static step runs without capture, so its equations are checked here
against HF generate (fp32 greedy, every drafter kind through the loop); on CUDA the device check replays it."""
import torch

from specheads.infer.drafters import build_drafter
from specheads.infer.engine.generate import generate
from specheads.infer.engine.graphs import BUCKETS, GraphedOwned, bucket
from specheads.infer.engine.runner import OwnedRunner, runner_for
from specheads.target import tiny_target


def test_bucket_rounds_up_and_stops_at_the_largest():
    assert [bucket(n) for n in (1, 2, 3, 5, 64)] == [1, 2, 4, 8, 64]
    assert bucket(BUCKETS[-1] + 1) is None


def _static_runner(target):
    runner = OwnedRunner(target, compiled=False)
    runner.graphed = GraphedOwned(runner.model)
    target._runner = (("auto", "auto"), runner)
    return runner


def test_static_step_is_exact_against_hf_greedy():
    target = tiny_target(vocab_size=256, hidden_size=64, num_layers=4, seed=0, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (7,), generator=g).tolist() * 2, torch.randint(3, 256, (9,), generator=g).tolist()]
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        refs.append(target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                          do_sample=False, pad_token_id=0)[0, len(p):].tolist())
    runner = _static_runner(target)
    from specheads.heads.base import HeadSpec, build_head

    heads = {k: build_head(HeadSpec(kind=k, **kw), target, token_counts=torch.arange(256.0)).eval()
             for k, kw in (("eagle3", {"draft_vocab_size": 64}), ("dspark", {"block_size": 4}))}
    makers = {"plain": lambda: build_drafter(target, "plain"),
              "prompt-lookup": lambda: build_drafter(target, "prompt-lookup", "5"),
              "eagle3": lambda: build_drafter(target, heads["eagle3"], "3,3,8"),  # trees with feature layers
              "dspark": lambda: build_drafter(target, heads["dspark"], "3")}
    for name, make in makers.items():
        for p, ref in zip(prompts, refs):
            r = generate(target, make(), p, max_new_tokens=24)
            assert r.ids == ref, name
    assert runner.graphed.graphs, "the static steps ran (one per bucket, layers and logit rows)"
    assert all(key[0] in BUCKETS for key in runner.graphed.graphs)


def test_compile_flag_is_checked_and_off_runs_pytorch_ops():
    target = tiny_target(vocab_size=256, hidden_size=64, num_layers=2, seed=0, dtype=torch.float32)
    target.compile = "sometimes"
    try:
        runner_for(target)
        raise AssertionError("a bad --compile value must be refused")
    except Exception as e:  # noqa: BLE001
        assert "--compile" in str(e)
    target.compile = "on"  # fp32 on a CPU: no compiled path, refused with the reason
    try:
        runner_for(target)
        raise AssertionError("--compile on without a compiled path must be refused")
    except Exception as e:  # noqa: BLE001
        assert "--compile on" in str(e)
    target.compile = "off"
    assert runner_for(target).compiled == ""


def test_static_step_serves_the_cost_profile_outside_inference_mode():
    from specheads.infer.scheduling.profile import measure_verify_cost

    target = tiny_target(vocab_size=256, hidden_size=64, num_layers=2, seed=0, dtype=torch.float32)
    runner = _static_runner(target)
    got = measure_verify_cost(target, sizes=(1, 2, 4), context=16, repeats=1)
    assert set(got["relative"]) == {"1", "2", "4"}
    assert {k[0] for k in runner.graphed.graphs} == {1, 2, 4}
