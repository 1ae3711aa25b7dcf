"""The bundled offline models: a catalogue of names and dimensions importable without torch
(``catalogue``), and the builders that turn them into circuit-tracer models (``builders``).
"""
