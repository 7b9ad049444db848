"""Multi-turn environments (rl/envs/base.py), their runner, and the shipped ones.

from rl.envs import EnvRunner, Turn, get_environment, register_environment
"""

from rl.envs import retry  # noqa: F401  (registers "retry")
from rl.envs.base import (
    ENVIRONMENTS,
    Environment,
    Transcript,
    Turn,
    check_turn,
    register_environment,
)
from rl.envs.runner import ENDED, EnvRunner


def get_environment(name: str):
    """The environment factory registered under `name` (a ValueError lists the names)."""
    return ENVIRONMENTS.get(name)


__all__ = [
    "ENDED",
    "ENVIRONMENTS",
    "EnvRunner",
    "Environment",
    "Transcript",
    "Turn",
    "check_turn",
    "get_environment",
    "register_environment",
]
