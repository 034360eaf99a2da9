"""The phases of a call's life, each in its own module; ``CallQueue.objects`` is their door."""
