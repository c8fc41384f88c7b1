"""How far can the batch grow? The batch-size sweep (``bigbatch study``) with its
report and plots, and the noise-scale probe (``bigbatch gns``)."""

from .sweep import StudyConfig, run_study

__all__ = ["StudyConfig", "run_study"]
