"""The engine loop's settings and the step deadline's growth, where the engine's modules import them from;
defined in the settings tree (settings/engine.py), with every other setting."""

from settings.engine import STEP_SECONDS_PER_TOKEN, EngineOptions

__all__ = ["STEP_SECONDS_PER_TOKEN", "EngineOptions"]
