"""URLs of the dispatcher's HTTP API; a project includes them under a prefix (here ``api/``)."""
from django.urls import path

from dispatcher import api

app_name = "dispatcher"

urlpatterns = [
    path("calls/", api.enqueue, name="enqueue"),
    path("calls/<int:call_id>/", api.call_status, name="call-status"),
]
