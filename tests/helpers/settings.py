"""Replay settings shared by the suite: a few short runs per call, no progress output."""

# A test that needs other figures spells out the difference: {**FAST_REPLAY, "budget_s": 0.002}
# one CPU window (cpu_windows): a second one, the default, is for figures that are compared
FAST_REPLAY = dict(budget_s=0.01, min_runs=3, warmup_runs=1, profile_runs=1, cold_budget_s=0.01,
                   cpu_windows=1, progress=False)
