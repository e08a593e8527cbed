"""The swarm's doors: what comes in from other nodes, read and admitted.

records (the run's signed DHT records, each read by one total parser), gate (admission in the
peer's process: who counts as a member), doors (admission in the averager process), convictions
(others' accusations, checked). The pure rules are in trust/; imports only swarm/transport/.
"""
