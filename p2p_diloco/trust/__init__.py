"""What a peer may believe of others, as pure functions.

admission (run key, certificates, revocations, config signatures), audit (reducer
accountability), robust (how a reducer combines its group's parts), wire (the parsers every
value from another node goes through). The swarm's side of it is swarm/trust/.
"""
