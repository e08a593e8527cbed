"""Reading a run from outside: the observer, `status`, and the export of its model.

run_view (pure: what the observer makes of the records it polls), service (the observe loop,
status lines), web (the HTTP server; its dashboard page is static/), evaluate (the held-out loss
of an agreed state), export and card (a checkpoint as a `transformers` folder with its
provenance). The observer reads the swarm through swarm/run_reader.py and publishes nothing.
"""
