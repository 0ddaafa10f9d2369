"""The run directory, the contract between stages (``docs/ARCHITECTURE.md``).

``layout`` (file names, a new run, paths inside it), ``files`` (atomic writes, checksums),
``read`` (manifest and modules table, typed), ``writer`` (the one writer of both).
"""
