"""What replay reads and writes around its per-call loop: the model rebuilt from the run
(``rebuild``), the next calls' inputs read ahead (``prefetch``), rows appended as they finish
(``progress``), and the calls shared among ranks under torchrun (``shard``).
"""
