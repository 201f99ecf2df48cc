"""`--set a.b=value` overrides: parsed into a nested dict and merged over the YAML config."""
from __future__ import annotations

from typing import Any

import yaml

__all__ = ["ConfigError", "parse_overrides", "merge"]


class ConfigError(ValueError):
    """A config problem the user must fix; the message names the key and the fix."""


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Turn ["etl.image_size=64", ...] into a nested dict; values are parsed as YAML scalars."""
    nested: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override '{item}' is not key=value; write e.g. --set etl.image_size=64")
        node = nested
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}' conflicts with an earlier override of '{part}'")
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return nested


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged
