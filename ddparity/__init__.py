"""ddparity: prove that data-parallel training matches single-device training.

Only re-exports, resolved on first use (PEP 562): importing ddparity imports neither
torch nor the harness, so the pytest plugin costs a session without ddparity tests
nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddparity.case import Case, batched, samples, whole
    from ddparity.errors import DdparityError, ParityError, UsageError
    from ddparity.harness.protocol import RankContext
    from ddparity.harness.ranks.stepping import StepContext
    from ddparity.harness.world.outcomes import RankOutcome
    from ddparity.harness.world.world import World
    from ddparity.report import HealthReport, ProfileReport, Report
    from ddparity.verbs.check import check
    from ddparity.verbs.health import health
    from ddparity.verbs.profile import profile
    from ddparity.verdicts import Divergence, RunResult

_HOMES = {
    "Case": "ddparity.case",
    "whole": "ddparity.case",
    "batched": "ddparity.case",
    "samples": "ddparity.case",
    "StepContext": "ddparity.harness.ranks.stepping",
    "check": "ddparity.verbs.check",
    "DdparityError": "ddparity.errors",
    "ParityError": "ddparity.errors",
    "UsageError": "ddparity.errors",
    "RankContext": "ddparity.harness.protocol",
    "RankOutcome": "ddparity.harness.world.outcomes",
    "World": "ddparity.harness.world.world",
    "HealthReport": "ddparity.report",
    "health": "ddparity.verbs.health",
    "ProfileReport": "ddparity.report",
    "profile": "ddparity.verbs.profile",
    "Divergence": "ddparity.verdicts",
    "Report": "ddparity.report",
    "RunResult": "ddparity.verdicts",
}

__all__ = [
    "Case",
    "DdparityError",
    "Divergence",
    "HealthReport",
    "ParityError",
    "ProfileReport",
    "RankContext",
    "RankOutcome",
    "Report",
    "RunResult",
    "StepContext",
    "UsageError",
    "World",
    "batched",
    "check",
    "health",
    "profile",
    "samples",
    "whole",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'ddparity' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
