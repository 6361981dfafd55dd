"""The public face of single-prompt speculative generation (README: `from specheads.infer.generate import
SpeculativeGenerator, generate`); the loop lives in infer/engine/generate.py."""
from specheads.infer.engine.generate import (  # noqa: F401
    PHASES, GenerationResult, GenerationStats, ScheduleStats, SpeculativeGenerator, encode_prompt, generate,
    phase_timer)
