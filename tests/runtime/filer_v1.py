"""Registers version 1 of the `filer` test graph (a worker before the deploy)."""

from runtime.graphs import register
from tests.runtime.filer import filer

register(filer("1"))
