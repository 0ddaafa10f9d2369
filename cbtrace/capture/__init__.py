"""Capture one real step of a model: module tree, live inputs and a Kineto trace.

``cbtrace.capture(model, out_dir, ...)`` (``cbtrace.api``) opens ``recorder.capture``; capturing a
model built from a provider spec is ``from_spec``; the CPU in-situ host times, ``host_times``.
"""
