"""Annotated traces: cbtrace's per-module figures put back into Kineto traces.

``cbtrace.annotate(run=..., trace=...)`` (``cbtrace.api``) calls ``write.annotate``; the streaming
rewrite is ``stream``, the figures per slice ``figures``, the appended ``cbtrace`` process
``layout``, the Perfetto protobuf ``pftrace``; ``trace_handler`` plugs into torch.profiler.
"""
