"""The VRAM estimator: the model of an attribution's memory, the registry of shapes, ``--ct-
batch-size auto``, and the ``ct-resources`` command."""
