"""``make run``: the whole stack on the embedded default, stopped together with Ctrl-C.

Starts the web server as in production (gunicorn with DEBUG off; static files collected and served
by WhiteNoise; on http://127.0.0.1:8000/admin/, or the port of ``PORT``: ``make run PORT=8001``), a
Celery worker, Celery beat (django-celery-beat's database scheduler) and a long-running dispenser,
after migrating. The database and broker are those of the environment: with none set, the SQLite
file and the filesystem broker under ``var/``. Ctrl-C (or SIGTERM) stops them all, each gracefully.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from support.processes import Processes, install_stop_signals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run web, worker, beat and dispenser together.")
    parser.add_argument(
        "--addr", default=f"127.0.0.1:{os.environ.get('PORT') or 8000}", help="where the web server listens (PORT sets the port)",
    )
    parser.add_argument("--concurrency", type=int, default=2, help="worker processes")
    args = parser.parse_args(argv)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    procs = Processes(env)
    restore = install_stop_signals()
    out = sys.stdout
    try:
        for command in (("migrate", "--noinput"), ("collectstatic", "--noinput", "-v", "0")):
            # collectstatic: with DEBUG off (the default) WhiteNoise serves the admin's styles
            # from STATIC_ROOT, as in production.
            result = procs.manage(*command)
            out.write(result.stdout + result.stderr)
            if result.returncode != 0:
                return result.returncode
        out.write(
            f"\nAdmin: http://{args.addr}/admin/  (dashboard: http://{args.addr}/dispatcher/dashboard/)\n"
            "First admin user (in another terminal): .venv/bin/python manage.py createsuperuser\n"
            "Ctrl-C stops everything.\n\n"
        )
        out.flush()
        py = sys.executable
        procs.start(
            "web", py, "-m", "gunicorn", "project.wsgi:application", "--bind", args.addr, "--workers", "2",
            prefix_output=out,
        )
        procs.start(
            "worker", py, "-m", "celery", "-A", "project", "worker", "-l", "info", "-c", str(args.concurrency),
            "--without-mingle", "--without-gossip", "--without-heartbeat", prefix_output=out,
        )
        procs.start("beat", py, "-m", "celery", "-A", "project", "beat", "-l", "info", prefix_output=out)
        procs.start("dispenser", py, "manage.py", "dispense", "--loop", prefix_output=out)
        while True:
            ended = procs.exited()
            if ended:
                out.write(f"stopping: {', '.join(f'{name} exited with {rc}' for name, rc in ended)}\n")
                return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        out.write("\nstopping web, worker, beat and dispenser\n")
        return 0
    finally:
        # Each process stops its own children: gunicorn's master its workers, Celery's worker its pool.
        procs.stop_all(leaders=True)
        restore()


if __name__ == "__main__":
    sys.exit(main())
