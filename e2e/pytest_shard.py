"""pytest plugin: keep every n-th collected test, so one suite runs as n processes side by side.

Enabled by e2e/gpu_tests.py (``-p pytest_shard`` with e2e/ on PYTHONPATH) and driven by
``GLM5_TEST_SHARD=i/n``: shard i (0-based) keeps items i, i+n, i+2n, ... of the collection order,
which spreads each file's (and each parametrization's) compile and run cost over all shards.
Without the variable it changes nothing."""
from __future__ import annotations

import os


def shard_spec() -> tuple[int, int] | None:
    spec = os.environ.get("GLM5_TEST_SHARD", "")
    if not spec:
        return None
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"GLM5_TEST_SHARD must be i/n, got {spec!r}") from None
    if not 0 <= i < n:
        raise ValueError(f"GLM5_TEST_SHARD {spec!r}: need 0 <= i < n")
    return i, n


def pytest_collection_modifyitems(config, items):
    spec = shard_spec()
    if spec is None:
        return
    i, n = spec
    keep = [it for k, it in enumerate(items) if k % n == i]
    drop = [it for k, it in enumerate(items) if k % n != i]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
