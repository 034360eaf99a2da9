"""Keys set up as a site's keys in use are, for tests and benchmarks that empty the tables."""
from __future__ import annotations

from collections.abc import Sequence


def mark_answered(keys: Sequence[str]) -> None:
    """Mark keys answered, as keys a site has called before are (a call of each has finished):
    their calls may share messages from the first pass. A key no call has finished under sends its
    calls one per message until one does (README, "Calls per message")."""
    from django.db.models.functions import Now

    from dispatcher.models import KeyState

    KeyState.objects.bulk_create([KeyState(key=key) for key in keys], ignore_conflicts=True)
    KeyState.objects.filter(key__in=keys).update(answered_at=Now())
