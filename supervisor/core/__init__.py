"""The supervisor's core: its state and decisions as plain objects, no I/O.

What a request is and how a batch orders it (requests.py), what waits for a batch
(inbox.py), a batch as one store transaction (transaction.py), the one hand-off of a
query to the pool (handoff.py), and what the batches learn of their own timing
(linger.py). The shell around it (server.py and its runners) reads sockets, keeps
timers and writes answers.
"""
