"""One peer's rounds, carried out on its replica.

replica (the state, trainer, data stream, totals and journal; changed only by commit and
adopt), driver (the round: inner phase, averaging, outer step, agreement, commit), averaging
(one round's all-reduce outcome), sync (agreement and catch-up), joining (what a starting
peer makes of the run it found). They reach other peers only through protocol/network's
`Swarm`, and decide by protocol/'s pure functions.
"""
