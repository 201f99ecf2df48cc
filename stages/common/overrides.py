"""`--set a.b=value` overrides: parsed into a nested dict and merged over the YAML config file, read here."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger(__name__)

__all__ = ["ConfigError", "parse_overrides", "merge", "read_config_file"]


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


class _UniqueKeys(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping: YAML keeps the last silently, so
    `lr: 0.1` and `lr: 0.2` in one file ran with 0.2 and no word."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise ConfigError(f"'{key}' is set twice in one section (line {key_node.start_mark.line + 1}); "
                                  "keep one of the two")
            seen.add(key)
        return super().construct_mapping(node, deep)


_SAID_EMPTY: set[str] = set()


def read_config_file(path: Path) -> dict[str, Any]:
    """A YAML config file's sections; ConfigError naming the file and the fix."""
    if not path.is_file():
        raise ConfigError(f"config file '{path}' not found; pass --config with an existing YAML file")
    text = path.read_text()
    try:
        data = yaml.load(text, Loader=_UniqueKeys)
    except ConfigError as e:
        raise ConfigError(f"config file '{path}': {e}") from None
    except yaml.YAMLError as e:
        fix = "; indent with spaces, not tabs" if "\t" in text else ""
        raise ConfigError(f"config file '{path}' is not valid YAML{fix}: {e}") from None
    if data is None:
        if str(path) not in _SAID_EMPTY:  # the CLI reads the file twice (Ray's address first)
            _SAID_EMPTY.add(str(path))
            log.warning("config file '%s' is empty: every key has its default", path)
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of sections (ray, etl, train, ...)")
    return data

