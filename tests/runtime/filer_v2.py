"""Registers version 2 of the `filer` test graph and the migration 1 → 2 — and nothing of
version 1 (a worker after the deploy)."""

from runtime.graphs import register, registry
from tests.runtime.filer import filer, migrate_1_to_2

register(filer("2"))
registry.register_migration("filer", "1", "2", migrate_1_to_2)
