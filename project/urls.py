from django.contrib import admin
from django.urls import include, path

from dispatcher import api
from dispatcher.dashboard import dashboard_view
from dispatcher.metrics import metrics_view
from project import views

# The paths of earlier releases answer still (bookmarks, Prometheus scrape configs, API clients),
# with the same views; every link the app renders names the dispatcher/ paths below. The
# dashboard's comes before admin.site.urls, whose catch-all would otherwise answer it.
legacy = [
    path("admin/dispatcher/dashboard/", admin.site.admin_view(dashboard_view)),
    path("metrics", metrics_view),
    path("api/calls/", api.enqueue),
    path("api/calls/<int:call_id>/", api.call_status),
]

urlpatterns = [
    *legacy,
    path("admin/", admin.site.urls),
    # The dashboard, /dispatcher/metrics and the JSON API, as any site routes them (README).
    path("dispatcher/", include("dispatcher.urls")),
    path("example/notify/", views.notify_partner, name="example-notify"),
]
