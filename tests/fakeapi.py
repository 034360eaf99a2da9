"""Moved to ``support.fakeapi`` (shared with the benchmarks); this name stays for code written against it."""
from support.fakeapi import Arrival, Bucket, FakeAPI, Smooth, Window, max_in_window  # noqa: F401
