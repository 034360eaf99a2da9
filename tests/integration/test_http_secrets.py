"""Credentials for the http handler come from settings by name; they are never stored in params."""
from __future__ import annotations

import pytest

from dispatcher.exceptions import PermanentError
from dispatcher.handlers import resolve_headers
from dispatcher.models import CallQueue

pytestmark = pytest.mark.django_db


def test_a_credential_header_in_clear_is_refused_at_send():
    params = {"method": "GET", "url": "http://127.0.0.1:9/", "headers": {"Authorization": "Bearer abc123"}}
    with pytest.raises(ValueError, match="secret"):
        CallQueue.objects.send("http", params)
    assert not CallQueue.objects.exists()


def test_a_credential_by_setting_name_is_stored_as_the_name_and_filled_at_run_time(settings):
    settings.DISPATCHER_HTTP_SECRETS = "PARTNER_TOKEN"
    settings.PARTNER_TOKEN = "Bearer s3cr3t"
    params = {"method": "GET", "url": "http://127.0.0.1:9/", "headers": {"Authorization": {"secret": "PARTNER_TOKEN"}}}
    call = CallQueue.objects.send("http", params)
    assert "s3cr3t" not in str(CallQueue.objects.get(pk=call.pk).params)
    assert resolve_headers(call.params["headers"]) == {"Authorization": "Bearer s3cr3t"}


def test_only_listed_settings_may_be_referenced(settings):
    settings.DISPATCHER_HTTP_SECRETS = "PARTNER_TOKEN"
    params = {"method": "GET", "url": "http://127.0.0.1:9/", "headers": {"X-Key": {"secret": "SECRET_KEY"}}}
    with pytest.raises(ValueError, match="not listed"):
        CallQueue.objects.send("http", params)
    with pytest.raises(PermanentError):
        resolve_headers({"X-Key": {"secret": "SECRET_KEY"}})
