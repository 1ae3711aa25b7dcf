"""The run's state and each test's way through it: the runtime, and the per-test accounting
(needs, figures, strict checks)."""
