"""Claim one key set's due calls as a dispenser pass would, for tests that look at one key set."""
from __future__ import annotations

from dataclasses import dataclass

from dispatcher.limits.catalog import Policies
from dispatcher.limits.gate import Verdict
from dispatcher.managers import Claimed
from dispatcher.models import CallQueue


@dataclass
class OneKeySet:
    calls: list[Claimed]
    verdict: Verdict


def claim(key_set: str, limit: int, policies: Policies | None = None) -> OneKeySet:
    """Claim up to ``limit`` due calls of one key set, as many as its keys have room for."""
    batch = CallQueue.objects.claim_batch([key_set], limit, policies or Policies.load())
    return OneKeySet(batch.calls, batch.verdicts[key_set])
