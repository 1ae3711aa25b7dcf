"""pytest-xdist: binding each worker to a GPU."""
