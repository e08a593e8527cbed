"""A node in the hivemind DHT and the processes behind it.

DHT start and identity, entry nodes, reply streams, whether a key is in use, hivemind's child
processes (forks, start deadlines, stacks). Imports nothing else of swarm/.
"""
