"""Primitives every layer shares: the one-line user error (`errors`), file hashing and the metrics.jsonl reader
(`fileio`), host synchronisations counted (`syncs`), and test-only fault injection at named points (`faults`).
May import nothing of finetune's.
"""
