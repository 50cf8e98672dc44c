"""Gate logic independent of pytest: thresholds, speed statistics, baseline store, reports.

The pytest plugin (``pytest_distillgates``) is a thin layer over this package.
"""

from distillgates.gates.baselines import (
    BaselineEntry,
    BaselineError,
    BaselineStore,
    CrossHardwareBaseline,
    MissingBaseline,
)
from distillgates.gates.core import (
    Gate,
    GateContext,
    GateFailure,
    GateInconclusive,
    GateNotMeasured,
    GateRecord,
    GateStopped,
    SpeedSettings,
)
from distillgates.gates.stats import SpeedComparison, compare_quantiles, sequential_speed_gate

__all__ = [
    "BaselineEntry",
    "BaselineError",
    "BaselineStore",
    "CrossHardwareBaseline",
    "Gate",
    "GateContext",
    "GateFailure",
    "GateInconclusive",
    "GateNotMeasured",
    "GateRecord",
    "GateStopped",
    "MissingBaseline",
    "SpeedComparison",
    "SpeedSettings",
    "compare_quantiles",
    "sequential_speed_gate",
]
