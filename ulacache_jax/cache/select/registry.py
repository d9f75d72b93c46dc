"""Which selection rule a cache runs: the default rules by name (an immutable mapping), a way to add one without
editing this file, and the rules whose state a cache keeps.

A CacheConfig names its rule by `CacheConfig.selection`: None resolves the built-in rule from the config's own
fields (key_channels 0: Quest; key_channels C: the key copy; label_bits 8 / 4: labels), a rule object (frozen,
hashable: it is part of the static config) is used as given. A new rule is one file (a `SelectionRule` subclass)
and a config value: `CacheConfig(..., selection=MyRule(...))`; `register_rule` makes a mapping that also names it,
for tools that pick rules by name.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from ulacache_jax.cache.select.key_copy import KeyCopy
from ulacache_jax.cache.select.labels import Labels
from ulacache_jax.cache.select.quest import Quest
from ulacache_jax.cache.select.rule import SelectionRule

DEFAULT_RULES: Mapping[str, type] = MappingProxyType({"quest": Quest, "key_copy": KeyCopy, "labels": Labels})


def register_rule(name: str, rule: type, rules: Mapping[str, type] = DEFAULT_RULES) -> Mapping[str, type]:
    """A new read-only mapping: `rules` plus `rule` (a SelectionRule subclass) under `name` (not already taken)."""
    if not (isinstance(rule, type) and issubclass(rule, SelectionRule)):
        raise ValueError(f"register_rule: {rule!r} is not a SelectionRule subclass")
    if name in rules:
        raise ValueError(f"register_rule: {name!r} is already a rule ({rules[name].__name__})")
    return MappingProxyType({**rules, name: rule})


def default_name(config) -> str:
    """The built-in rule a config's fields describe: 'quest', 'key_copy' or 'labels'."""
    return "labels" if config.label_bits else "key_copy" if config.key_channels else "quest"


def resolve(config, rules: Mapping[str, type] = DEFAULT_RULES) -> SelectionRule:
    """The rule of `config`: config.selection when it is a rule object, else the built-in one from its fields."""
    if config.selection is not None:
        return config.selection
    return rules[default_name(config)].from_config(config)


def kept_rules(config) -> tuple[SelectionRule, ...]:
    """The rules whose state the cache keeps, in the order their hooks run: Quest (the key summaries, kept for every
    rule: see quest.py), then the scoring rule when it is another."""
    rule = resolve(config)
    quest = Quest.from_config(config)
    return (quest,) if isinstance(rule, Quest) else (quest, rule)
