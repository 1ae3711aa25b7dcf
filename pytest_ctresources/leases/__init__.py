"""One VRAM budget per GPU for every run of the user on a host: the ledger and the per-test
leases."""
