"""The project's logs: each line once (in a worker too), routine beat tasks and httpx quiet at INFO, honest task results."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dispatcher.models import CallQueue
from dispatcher.tasks import run_call
from support.processes import ROOT
from tests.claims import claim

# As a worker sets up its logging (`celery -A project worker -l info`), then one record of each kind.
WORKER_LOGS = """
import logging, os
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
from project.celery import app
import django
django.setup()
app.log.setup(loglevel="INFO")
logging.getLogger("dispatcher").info("run_error call=1")
logging.getLogger("django.request").warning("Not Found: /nothing")
logging.getLogger("httpx").info("HTTP Request: GET http://127.0.0.1/ 200 OK")
logging.getLogger("celery.beat").info("Scheduler: Sending due task %s (%s)", "dispatcher.dispense", "dispatcher.dispense")
logging.getLogger("celery.beat").info("Scheduler: Sending due task %s (%s)", "nightly", "mysite.nightly")
received = {"name": "dispatcher.dispense", "id": "1"}
logging.getLogger("celery.worker.strategy").info("Task %(name)s[%(id)s] received", received, extra={"data": received})
done = {"name": "dispatcher.run_call", "id": "2", "runtime": 0.1, "return_value": "'call 1 done'"}
logging.getLogger("celery.app.trace").info("Task %(name)s[%(id)s] succeeded", done, extra={"data": done})
logging.getLogger("celery.beat").warning("beat: a warning about %s", "dispatcher.dispense")
"""


@pytest.fixture(scope="module")
def worker_log(tmp_path_factory) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJANGO_SETTINGS")}
    env.update(DISPATCHER_VAR_DIR=str(tmp_path_factory.mktemp("var")), PYTHONPATH=str(ROOT))
    env.pop("DATABASE_URL", None)
    done = subprocess.run(
        [sys.executable, "-c", WORKER_LOGS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout + done.stderr


def test_each_dispatcher_line_is_written_once_in_a_worker(worker_log):
    assert worker_log.count("run_error call=1") == 1
    assert worker_log.count("Not Found: /nothing") == 1
    assert worker_log.count("Task dispatcher.run_call[2] succeeded") == 1


def test_beat_s_routine_tasks_and_httpx_requests_stay_out_of_the_info_log(worker_log):
    assert "HTTP Request" not in worker_log
    assert "Sending due task dispatcher.dispense" not in worker_log
    assert "Task dispatcher.dispense[1] received" not in worker_log
    # Other schedules, and warnings of the routine ones, still show.
    assert worker_log.count("Sending due task nightly (mysite.nightly)") == 1
    assert worker_log.count("beat: a warning about dispatcher.dispense") == 1


@pytest.mark.django_db(transaction=True)
def test_a_worker_s_task_says_what_happened_to_the_call():
    failing = CallQueue.objects.send("explode", {"permanent": True})
    (claimed,) = claim(failing.key_set, 1).calls
    assert run_call(claimed.id, claimed.dispatch_no) == f"call {failing.id} failed (a permanent error)"
    assert run_call(claimed.id, claimed.dispatch_no) == f"call {failing.id} skipped (a stale or duplicate delivery)"
    retried = CallQueue.objects.send("explode", {}, max_attempts=3)
    (claimed,) = claim(retried.key_set, 1).calls
    assert run_call(claimed.id, claimed.dispatch_no).startswith(f"call {retried.id} raised an error (retried")
