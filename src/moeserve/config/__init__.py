"""What the engine is told before it starts: the engine config (config/engine.py, with the CLI
generated from its fields), the model's shape (spec.py), the presets of well-known models
(presets.py) and the registry that every pluggable part uses (registry.py). Nothing here
touches a device."""

from moeserve.config.engine import (EngineConfig, add_config_arguments, config_errors,
                                    config_from_args)

__all__ = ["EngineConfig", "add_config_arguments", "config_errors", "config_from_args"]
