"""The timer contract and the timer chain.

``contract`` (what a timer receives, how it is configured, what it returns) and
``graph_capture`` (what every CUDA graph capture of a call needs) are the layer timers build on:
they import nothing else of ``cbtrace.replay``. ``choice`` picks, in order, the registered
timers that may time a call, and falls back from one to the next.
"""
