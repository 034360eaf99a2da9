"""The dispatcher's pages: a site includes them once, ``path("dispatcher/", include("dispatcher.urls"))``.

The dashboard (staff with view permission; others go to the admin's login), ``metrics`` (Prometheus
text; a token, staff, or public by setting) and the JSON API (``calls/``, ``calls/<id>/``; bearer tokens).
"""
from django.contrib import admin
from django.urls import path

from dispatcher import api
from dispatcher.dashboard import dashboard_view
from dispatcher.metrics import metrics_view

app_name = "dispatcher"

urlpatterns = [
    # Through the admin's login: a visitor who is not staff is sent to log in, not refused.
    path("dashboard/", admin.site.admin_view(dashboard_view), name="dashboard"),
    path("metrics", metrics_view, name="metrics"),
    path("calls/", api.enqueue, name="enqueue"),
    path("calls/<int:call_id>/", api.call_status, name="call-status"),
]
