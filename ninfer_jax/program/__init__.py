"""The Program: pools, exact-B step functions, sampling and PendingBatch (DESIGN §2, §6, §10)."""
