"""Errors a user can cause, as opposed to bugs.

The CLI prints these as one line and exits with status 2; library users can
catch them as `ValueError`.
"""


class ConfigError(ValueError):
    """A bad configuration key, value, file or combination of options."""
