"""The DiLoCo protocol's decisions, as pure functions of what the swarm published, and the seam.

agreement (whom to wait for, the majority, adopt or catch up), budget (when a speed-aware round
ends), genesis (what a run is beyond its name), outer (the outer step, pseudo-gradients, digests),
links (who reduces how much), codecs (how a pseudo-gradient travels), deadlines (every wait's
bound, I3), pending (a result on its way), network (the `Swarm` protocol the round talks to, and
`Solo`). No I/O of their own: round/ carries them out, swarm/ does the network.
"""
