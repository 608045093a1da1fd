"""The scheduler's settings, where the scheduler's modules import them from; defined in the settings tree
(settings/scheduler.py), with every other setting."""

from settings.scheduler import PREEMPTION_MODES, PreemptionMode, SchedulerConfig

__all__ = ["PREEMPTION_MODES", "PreemptionMode", "SchedulerConfig"]
