"""The tuner's error class.

>>> err = TuneError("symbol 'batch_size' is defined twice", primitive="Space.create_symbol",
...                 values={"name": "batch_size"}, fix="give the second symbol another name")
>>> isinstance(err, ScheduleError)
True
>>> print(err)
Space.create_symbol(...): symbol 'batch_size' is defined twice
    values: name='batch_size'
    fix: give the second symbol another name
"""

from __future__ import annotations

from ..errors import ScheduleError

__all__ = ["TuneError"]


class TuneError(ScheduleError):
    """A search space, strategy, database or tuning run was set up wrongly."""


class TuneDatabaseError(TuneError):
    """A results file the tuner did not write: not SQLite, another program's or another
    schema's database, or a row whose contents the tuner never writes."""


__all__ += ["TuneDatabaseError"]
