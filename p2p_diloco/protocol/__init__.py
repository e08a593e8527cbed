"""The DiLoCo round: its decisions as pure functions, and the round carried out.

Pure: agreement (whom to wait for, majority, adopt or catch up), budget (when a speed-aware round
ends), codecs, deadlines, genesis, links, outer (the outer step, digests), pending. Carried out:
round, averaging, sync and joining, which reach other peers only through network's `Swarm`
protocol. Nothing here imports hivemind.
"""
