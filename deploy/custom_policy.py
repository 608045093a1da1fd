"""An example of a user-written scheduling policy: shortest job first, with the base class's aging guard.

    vllm-serve --scheduling-policy deploy.custom_policy:ShortestJobFirst --aging-interval 5

The module only needs to be importable by the scheduler (on PYTHONPATH or installed).
"""

from __future__ import annotations

from scheduler_node.core.policy import Policy
from scheduler_node.core.request import Request


class ShortestJobFirst(Policy):
    """Fewest tokens left to generate first; one priority point per aging interval keeps long jobs moving."""

    name = "sjf"

    def effective_priority(self, req: Request, now: float) -> float:
        remaining = req.stop.max_tokens - len(req.output_token_ids)
        return self._age_points(req, now) - remaining
