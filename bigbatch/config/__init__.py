"""The one typed configuration: ``Strategy`` and its Fleet-named sections, TOML in
and out, the batch plan (including its elastic resume), schedules and scaling rules."""

from . import elastic, scaling, schedules
from .scaling import scale_lr
from .schedules import Schedule
from .strategy import BatchPlan, Strategy

__all__ = ["Strategy", "BatchPlan", "Schedule", "scale_lr", "elastic", "scaling", "schedules"]
