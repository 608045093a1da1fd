"""The shared world of the end-to-end tests (tests/support/clusters.py): started on first use, once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.clusters import MeteredCluster, idle, shared_world


@pytest.fixture(scope="session")
def shared_world_session(tiny_llama_dir: Path) -> Iterator[MeteredCluster]:
    """The shared world itself, for module-scoped fixtures (stubs, clients); a test asks for `shared_cluster`."""
    with shared_world(tiny_llama_dir) as cluster:
        yield cluster


@pytest.fixture
def shared_cluster(shared_world_session: MeteredCluster) -> MeteredCluster:
    """The shared world, idle: what an earlier test ran has ended and freed its blocks."""
    idle(shared_world_session)
    return shared_world_session
