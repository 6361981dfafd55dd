"""A recipe: one YAML read by both `specheads prepare` and `specheads train`.

Each section's dataclass lives with the code that uses it; this file only assembles them. It is train/'s: five of its
sections are train/'s own configs, and train/heldout reads a run's train_config.yaml back with it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specheads.heads.base import HeadSpec
from specheads.train.data import DataConfig
from specheads.train.evaluate import EvalConfig
from specheads.train.features import FeatureConfig
from specheads.train.launch import LaunchConfig
from specheads.train.settings import TrainConfig


@dataclass
class TargetConfig:
    name: str = "smollm2-135m"  # hub id, local folder, .gguf file, or alias
    dtype: str = "bfloat16"  # the frozen target runs in bf16 for features (fp32 for exactness checks)
    trust_remote_code: bool = False  # off unless asked
    device_map: str | dict | None = None  # where prepare (regeneration, extraction), eval's heldout:RUN and online
    # features run it: auto (split over the visible GPUs, cpu without any), cpu, cuda, cuda:N, or a mapping module
    # name -> device as transformers' from_pretrained takes it; None = cpu, as before (specheads.target)

    def __post_init__(self):
        from specheads.target import check_device_map

        check_device_map(self.device_map)


@dataclass
class Recipe:
    output_dir: str = "runs/default"  # prepare writes <output_dir>/data and /features; train writes checkpoints
    seed: int = 0
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    features: FeatureConfig = field(default_factory=FeatureConfig)
    head: HeadSpec = field(default_factory=HeadSpec)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)  # nodes x processes for `specheads launch`
