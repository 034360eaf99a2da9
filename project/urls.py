from django.contrib import admin
from django.urls import include, path

from dispatcher.dashboard import dashboard_view
from dispatcher.metrics import metrics_view
from project import views

urlpatterns = [
    # Before admin.site.urls, whose catch-all would otherwise answer this path.
    path("admin/dispatcher/dashboard/", admin.site.admin_view(dashboard_view), name="dispatcher_dashboard"),
    path("admin/", admin.site.urls),
    path("metrics", metrics_view, name="metrics"),
    path("api/", include("dispatcher.urls")),
    path("example/notify/", views.notify_partner, name="example-notify"),
]
