"""An example of an app's own view enqueueing a call, the way a project would write it."""
from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_POST

from dispatcher.models import CallQueue


@login_required
@require_POST
def notify_partner(request: HttpRequest) -> JsonResponse:
    """Record the user's request and enqueue a webhook to a partner API in one transaction.

    If anything in the block fails, the call is never stored; once it commits, the dispenser
    sends it as fast as the partner's limits allow.
    """
    url = request.POST.get("url", "")
    try:
        with transaction.atomic():
            # ... the app's own writes go here, in the same transaction ...
            call = CallQueue.objects.send(
                "http",
                {"method": "POST", "url": url, "json": {"user": request.user.get_username()}},
                keys=[f"partner:{request.user.pk}"],
            )
    except ValueError as exc:  # send() refuses bad input with a ValueError subclass
        return JsonResponse({"error": str(exc)}, status=400)
    return JsonResponse({"id": call.id}, status=202)
