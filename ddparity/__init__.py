"""ddparity: prove that data-parallel training matches single-device training.

Only re-exports; importing ddparity does not import torch (the pytest plugin relies on it).
"""

from ddparity.case import Case
from ddparity.controller import check
from ddparity.errors import DdparityError, ParityError, UsageError
from ddparity.harness.protocol import RankContext
from ddparity.harness.world import RankOutcome, World
from ddparity.report import Divergence, Report, RunResult

__all__ = [
    "Case",
    "DdparityError",
    "Divergence",
    "ParityError",
    "RankContext",
    "RankOutcome",
    "Report",
    "RunResult",
    "UsageError",
    "World",
    "check",
]
__version__ = "0.1.0"
