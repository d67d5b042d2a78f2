"""The scheduler's public name: `Scheduler` with its config and stats, wherever the engine, the
simulator and the tests import them from. Its parts are in scheduling/ (issue 79)."""

from site_engine.engine.core.scheduler_config import ClassLoad, SchedulerConfig, SchedulerStats
from site_engine.engine.core.scheduling.scheduler import Scheduler

__all__ = ["ClassLoad", "Scheduler", "SchedulerConfig", "SchedulerStats"]
