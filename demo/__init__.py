"""The demo: a fake partner API and a one-command tour of the dispatcher (`make demo`)."""
