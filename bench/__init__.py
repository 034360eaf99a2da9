"""Benchmarks of the dispatcher against real PostgreSQL, Redis and RabbitMQ: ``python -m bench``."""
