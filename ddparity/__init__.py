"""ddparity: prove that data-parallel training matches single-device training."""

from ddparity.errors import DdparityError, ParityError, UsageError
from ddparity.harness.protocol import RankContext
from ddparity.harness.world import World

__all__ = ["DdparityError", "ParityError", "RankContext", "UsageError", "World"]
__version__ = "0.1.0"
