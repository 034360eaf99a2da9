"""Rate limits: the policy shapes, which govern a key, the check, the locks and counters, and their edits."""
