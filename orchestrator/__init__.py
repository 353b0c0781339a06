"""A memory-aware experiment orchestrator on Ray Tune."""

__version__ = "0.1.0"
