"""Reporters: the icicle (icicle.html, icicle.svg), the summary table and the TensorBoard tab.

tree.py (module-call tree + layout) -> icicle_data.py (the JSON model, colours from
palette.py, numbers from fmt.py) -> icicle.py (HTML) / svg.py / tensorboard_plugin.py;
summary.py (terminal table); hooks.py registers "icicle", "svg" and "summary".
"""
