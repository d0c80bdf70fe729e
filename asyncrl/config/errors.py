"""`ConfigError`: what every config failure raises."""


class ConfigError(ValueError):
    """A config that cannot run; the message is one line naming the setting(s)."""
