"""Every schema key is read by a module that still mentions it, or is a listed no-op; every verl name leads to a
read key or is an ignored key with its reason (config/readers.py, config/verl_compat.py)."""

import fnmatch
import importlib
import inspect
import re

from rlhf_jax.config import schema
from rlhf_jax.config.readers import EVIDENCE, NO_OPS, READERS
from rlhf_jax.config.verl_compat import ALIASES, IGNORED


def _matches(pattern: str) -> list[str]:
    return [p for p in schema.key_paths() if fnmatch.fnmatchcase(p, pattern)]


def _mentions(source: str, path: str) -> bool:
    """The module's code names the key: its last name as an attribute, an item or a string (or its EVIDENCE)."""
    if path in EVIDENCE:
        return EVIDENCE[path] in source
    leaf = re.escape(path.rsplit(".", 1)[-1])
    return re.search(rf"(\.{leaf}\b|[\"']{leaf}[\"'])", source) is not None


def test_every_schema_key_has_a_reader_or_a_reason():
    read = {p for patterns in READERS.values() for pattern in patterns for p in _matches(pattern)}
    missing = [p for p in schema.key_paths() if p not in read and p not in NO_OPS]
    assert not missing, f"schema keys read nowhere (add the consumer to config/readers.py, or a reason): {missing}"
    assert all(reason.strip() for reason in NO_OPS.values())
    assert not set(NO_OPS) & read, "a key listed as a no-op is also read"


def test_every_reader_exists_and_still_mentions_its_keys():
    for module_name, patterns in READERS.items():
        source = inspect.getsource(importlib.import_module(module_name))
        for pattern in patterns:
            paths = _matches(pattern)
            assert paths, f"{module_name}: {pattern!r} names no schema key"
            stale = [p for p in paths if not _mentions(source, p)]
            assert not stale, f"{module_name} no longer mentions {stale}: update config/readers.py"
    for path in list(NO_OPS) + list(EVIDENCE):
        assert path in schema.DOCS, path


def test_every_verl_name_leads_somewhere():
    read = {p for patterns in READERS.values() for pattern in patterns for p in _matches(pattern)}
    for alias in ALIASES:
        assert alias.target in read, f"verl alias {alias.path} -> {alias.target}, which nothing reads"
        assert alias.fallback is None or alias.fallback in read, alias.path
        assert alias.path not in schema.DOCS, f"{alias.path} is a schema key and an alias"
    for entry in IGNORED:
        assert entry.reason.strip(), entry.pattern
        assert not _matches(entry.pattern), f"ignored verl key {entry.pattern} shadows schema keys"
    from rlhf_jax.config.dialects import atorch, roll, trainer_config, trinity

    for rule in roll.RULES + trinity.RULES + trainer_config.RULES + atorch.RULES:  # a key becomes a read schema key, is computed, or is ignored with a reason
        assert rule.to is None or rule.to in read, f"{rule.their} -> {rule.to}, which nothing reads"
        assert rule.maps or rule.used_by or rule.reason.strip(), rule.their


def test_a_key_without_a_reader_is_caught(monkeypatch):
    from rlhf_jax.config import readers

    loader = tuple(p for p in READERS["rlhf_jax.data.loader"] if p != "data.video_key")
    monkeypatch.setitem(readers.READERS, "rlhf_jax.data.loader", loader)
    read = {p for patterns in readers.READERS.values() for pattern in patterns for p in _matches(pattern)}
    assert "data.video_key" not in read
    # and a module that stopped reading a key it is listed for is caught by the source check
    assert not _mentions("def f(cfg):\n    return cfg.other\n", "data.video_key")
