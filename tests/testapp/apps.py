import json
import os

from django.apps import AppConfig


class TestAppConfig(AppConfig):
    name = "tests.testapp"
    label = "testapp"

    def ready(self) -> None:
        # A real worker's Tasks signals, written where the test that started it reads them.
        path = os.environ.get("TEST_TASK_SIGNALS")
        if not path:
            return
        try:
            from django.tasks.signals import task_finished, task_started
        except ImportError:  # Django 5.2: the backport
            from django_tasks.signals import task_finished, task_started

        def write(signal_name):
            def receiver(sender, task_result, **kwargs):
                line = {"signal": signal_name, "sender": sender.__name__, "id": task_result.id,
                        "status": str(task_result.status), "attempts": task_result.attempts,
                        "errors": [e.exception_class_path for e in task_result.errors]}
                with open(path, "a") as out:
                    out.write(json.dumps(line) + "\n")
            return receiver

        task_started.connect(write("started"), weak=False)
        task_finished.connect(write("finished"), weak=False)
