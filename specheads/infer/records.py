"""What one method reports for one prompt turn (`RunRecord`) and the method interface (`Method`): shared by the
benchmark (infer/bench.py) and the engines it drives (infer/llamacpp.py), so neither imports the other."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunRecord:
    """One method on one prompt turn."""

    method: str
    prompt_id: str
    category: str
    turn: int
    prompt_tokens: int
    new_tokens: int
    time_s: float
    target_forwards: int | None  # None = could not be counted
    step_tokens: list[int] | None  # tokens emitted by each target forward (sum = new_tokens); None = unknown
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    phase_times: dict[str, float] | None = None  # seconds per phase (ours only)
    schedule: dict[str, Any] | None = None  # the scheduler's figures (GenerationStats SCHEDULE_FIELDS), ours only


class Method:
    name: str = "method"
    info: dict[str, Any]

    def generate(self, input_ids: list[int], max_new_tokens: int) -> RunRecord:  # pragma: no cover - interface
        raise NotImplementedError
