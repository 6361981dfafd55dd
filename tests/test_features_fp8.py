"""FP8 feature shards (issue 50): hidden states stored as e4m3 with one fp32 scale per token row and layer, read back
as bf16 by every reader (FeatureDataset, the target sidecars), half the disk of bf16 shards, resumable like them."""
from __future__ import annotations

import pytest
import torch

from specheads.train import shards, teacher
from specheads.train.dataset import FeatureDataset
from specheads.train.features import FeatureConfig, write_features
from specheads.utils import SpecheadsError
from test_features import _rows


def test_encode_round_trip_is_within_e4m3_rounding():
    h = torch.randn(50, 2, 64) * torch.logspace(-3, 3, 50)[:, None, None]  # rows of very different magnitudes
    enc = shards.encode_hidden(h, "float8_e4m3fn")
    assert enc["hidden"].dtype == torch.float8_e4m3fn and enc["hidden_scale"].shape == (50, 2)

    class _H:  # what safe_open's handle gives: get_slice(name)[a:b]
        def get_slice(self, name):
            return enc[name]

    back = shards.read_hidden(_H(), 0, 50).float()
    rel = (back - h).abs() / h.abs().amax(-1, keepdim=True)
    assert rel.max() < 2 ** -4  # 3 mantissa bits: half an ulp of the row's largest value, bf16 rounding on top
    assert shards.encode_hidden(h, "bfloat16")["hidden"].dtype == torch.bfloat16


def test_fp8_shards_halve_the_disk_and_read_back_as_bf16(tiny, tmp_path):
    rows, L = _rows(9), tiny.num_layers
    m16 = write_features(tiny, rows, tmp_path / "bf16", [2, L], FeatureConfig(shard_tokens=60), progress=False)
    m8 = write_features(tiny, rows, tmp_path / "fp8", [2, L], FeatureConfig(shard_tokens=60, dtype="fp8"),
                        progress=False)
    assert m8["dtype"] == "float8_e4m3fn" and m16["dtype"] == "bfloat16" and m8["plan_key"] != m16["plan_key"]
    hidden16 = sum(s["num_tokens"] for s in m16["shards"]) * 2 * tiny.hidden_size * 2
    assert m8["bytes"] < m16["bytes"] - hidden16 / 2 * 0.8  # the hidden states take half (plus a scale per row)
    a, b = FeatureDataset(tmp_path / "bf16"), FeatureDataset(tmp_path / "fp8")
    for x, y in zip(a, b):
        assert y["hidden"].dtype == torch.bfloat16 and torch.equal(x["input_ids"], y["input_ids"])
        err = (y["hidden"].float() - x["hidden"].float()).abs().amax(-1) / x["hidden"].float().abs().amax(-1)
        assert err.max() < 0.07
    teacher.write_target_sidecars(tiny, tmp_path / "fp8", progress=False)  # the sidecars read fp8 shards too
    assert FeatureDataset(tmp_path / "fp8").has_targets


def test_fp8_folder_resumes_and_refuses_a_bf16_plan(tiny, tmp_path):
    rows, L = _rows(6), tiny.num_layers
    cfg = FeatureConfig(shard_tokens=50, dtype="float8_e4m3fn")
    ref = write_features(tiny, rows, tmp_path / "ref", [L], cfg, progress=False)

    def stop(k):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_features(tiny, rows, tmp_path / "run", [L], cfg, progress=False, after_shard=stop)
    done = write_features(tiny, rows, tmp_path / "run", [L], cfg, progress=False)
    assert done["complete"] and [s["conversation_ids"] for s in done["shards"]] == \
        [s["conversation_ids"] for s in ref["shards"]]
    for a, b in zip(FeatureDataset(tmp_path / "run"), FeatureDataset(tmp_path / "ref")):
        torch.testing.assert_close(a["hidden"].float(), b["hidden"].float(), atol=5e-2, rtol=7e-2)
    with pytest.raises(SpecheadsError, match="other data, target or layers"):  # the dtype is in the plan key
        write_features(tiny, rows, tmp_path / "run", [L], FeatureConfig(shard_tokens=50), progress=False)


def test_unknown_dtype_is_refused_by_name():
    with pytest.raises(SpecheadsError, match="features.dtype: 'int4'"):
        FeatureConfig(dtype="int4")
