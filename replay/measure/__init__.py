"""One call measured: ``prepare`` makes the call under test (the module on rotating input
``copies``), ``context`` puts it in the cache state it had in the step, ``plan`` lists the
``steps`` that measure it (``profiler_pass`` among them), ``reuse`` lets a call take what an
earlier call of the same work measured, and ``time_limit`` ends a call that hangs.
"""
