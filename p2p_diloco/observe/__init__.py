"""The observer: it reads a run's records and publishes nothing.

run_view (pure: what it makes of the records it polls), service (the observe loop, status
lines), web (the HTTP server; its dashboard page is static/), evaluate (its own held-out
loss). It reads the swarm through swarm/run_reader.py.
"""
