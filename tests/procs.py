"""Moved to ``support.processes`` (shared with the demo and the benchmarks); this name stays for code written against it."""
from support.processes import ROOT, Processes, database_url, wait_until  # noqa: F401
