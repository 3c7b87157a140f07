"""The config: its schema (schema.py: the dataclasses, compose), its keys (keys.py: unknown, renamed, typed) and its
checks (checks.py: values and every feature's refusals, `validate`)."""

from .checks import config_warnings, data_name_problems, nonfinite_problems, validate
from .keys import composition_problem, key_problem, schema_keys, unknown_keys, value_type_problem, yaml_bool_problems
from .schema import CONFIG_DIR, ConfigError, JustRLConfig, compose, register

__all__ = ["CONFIG_DIR", "ConfigError", "JustRLConfig", "compose", "composition_problem", "config_warnings",
           "data_name_problems", "key_problem", "nonfinite_problems", "register", "schema_keys", "unknown_keys",
           "validate", "value_type_problem", "yaml_bool_problems"]
