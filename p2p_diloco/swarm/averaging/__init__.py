"""The averager process and one averaging step.

Matchmaking and the consistent all-reduce, link probes, the all-gather's entries, the signed
ledger of parts and averages, and the audit after every all-reduce.
"""
