"""The averager process and one averaging step.

Matchmaking and the consistent all-reduce, link probes, the all-gather's entries, the signed
ledger of parts and averages, the audit after every all-reduce and the evidence of a conviction,
and the served state a joiner downloads. Imports swarm/trust/ and swarm/transport/.
"""
