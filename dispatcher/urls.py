"""The dispatcher's pages: a site includes them once, ``path("dispatcher/", include("dispatcher.urls"))``.

The dashboard and each key's page under it (staff with view permission; others go to the admin's login), ``metrics`` (Prometheus
text; a token, staff, or public by setting) and the JSON API (``calls/``, ``calls/<id>/``; bearer tokens).
"""
from django.contrib import admin
from django.urls import path

from dispatcher import api
from dispatcher.dashboard import dashboard_view, key_view
from dispatcher.metrics import metrics_view

app_name = "dispatcher"

urlpatterns = [
    # Through the admin's login: a visitor who is not staff is sent to log in, not refused.
    path("dashboard/", admin.site.admin_view(dashboard_view), name="dashboard"),
    # A key may hold any printable character, "/" included: the path converter takes it whole,
    # reverse() percent-encodes what a URL cannot carry, and the view validates it again.
    path("dashboard/key/<path:key>/", admin.site.admin_view(key_view), name="dashboard-key"),
    path("metrics", metrics_view, name="metrics"),
    path("calls/", api.enqueue, name="enqueue"),
    path("calls/<int:call_id>/", api.call_status, name="call-status"),
]
