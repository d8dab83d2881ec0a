"""The planner's error class.

>>> err = PlanError("tp=3 does not divide 8 heads", primitive="plan",
...                 values={"tp": 3}, fix="--tp 2")
>>> isinstance(err, ScheduleError)
True
"""

from __future__ import annotations

from ..errors import ScheduleError

__all__ = ["PlanError"]


class PlanError(ScheduleError):
    """A model, layout, device profile or option the planner cannot use."""
