"""Test helpers, imported as ``helpers.<module>`` (pytest puts tests/ on sys.path).

settings: FAST_REPLAY, the replay settings of the CPU suite (also the ``fast_replay`` fixture);
runs: run directories built by hand; sample_runs: synthetic runs of a real module tree;
equality: bitwise comparison of inputs; snapshots: store a call's inputs in one call;
servers: free ports, stopping servers, headless Chromium; spec_models: model specs loaded by path.
"""
