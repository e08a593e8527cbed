"""Admission and convictions, carried out in the swarm.

doors (admission in the averager process), gate (in the peer's process), convictions and the
evidence behind them. The pure rules are in trust/.
"""
