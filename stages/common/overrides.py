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
    if isinstance(items, (str, dict)):  # a library caller's one string was read as its characters
        raise ConfigError(f"overrides must be a list of 'key=value' strings, got a {type(items).__name__}; "
                          "write e.g. load_config(path, ['train.epochs=3'])")
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
        try:
            node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:  # `[1`, `*x`, `@x`: a traceback had come before any error handling
            first = str(e).splitlines()[0]
            raise ConfigError(f"override '{item}': the value is not valid YAML ({first}); quote it as a string "
                              f"(--set '{key.strip()}=\"...\"') or close its brackets") from None
    return nested


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _refuse_repeats(node: yaml.Node, where: str = "", walked: set[int] | None = None) -> None:
    """A key given twice in one mapping is a ConfigError naming its section and line: YAML keeps the
    last silently, so `lr: 0.1` and `lr: 0.2` in one file ran with 0.2 and no word. An alias is the
    node it names: each node is walked once (an anchor inside itself had recursed for ever)."""
    walked = set() if walked is None else walked
    if id(node) in walked:
        return
    walked.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_repeats(item, f"{where}[{i}]", walked)
    if not isinstance(node, yaml.MappingNode):
        return
    seen: set[str] = set()
    for key_node, value in node.value:
        key = str(key_node.value)
        name = f"{where}.{key}" if where else key
        if key in seen and key != "<<":  # merge keys may repeat
            raise ConfigError(f"'{name}' is set twice (line {key_node.start_mark.line + 1}); keep one of the two")
        seen.add(key)
        _refuse_repeats(value, name, walked)


_SAID_EMPTY: set[str] = set()


def read_config_file(path: Path) -> dict[str, Any]:
    """A YAML config file's sections; ConfigError naming the file and the fix."""
    if path.is_dir():
        raise ConfigError(f"config file '{path}' is a folder; pass --config with a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file '{path}' not found; pass --config with an existing YAML file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file '{path}' is not UTF-8 text ({e.reason} at byte {e.start}); save it as "
                          f"UTF-8 YAML") from None
    try:
        tree = yaml.compose(text, Loader=yaml.SafeLoader)
        if tree is not None:
            _refuse_repeats(tree)
        data = yaml.safe_load(text)
    except ConfigError as e:
        raise ConfigError(f"config file '{path}': {e}") from None
    except yaml.YAMLError as e:  # its marks say "<unicode string>" for text: name the file instead
        fix = "; indent with spaces, not tabs" if "\t" in text else ""
        where = str(e).replace('"<unicode string>"', f"'{path}'")
        raise ConfigError(f"config file '{path}' is not valid YAML{fix}: {where}") from None
    if data is None:
        if str(path) not in _SAID_EMPTY:  # the CLI reads the file twice (Ray's address first)
            _SAID_EMPTY.add(str(path))
            log.warning("config file '%s' is empty: every key has its default", path)
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of sections (ray, etl, train, ...)")
    return data

