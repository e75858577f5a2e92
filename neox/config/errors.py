"""The one error type for bad configs: its message names the file, key, value and the fix."""


class ConfigError(ValueError):
    """A config problem found before anything was launched."""
