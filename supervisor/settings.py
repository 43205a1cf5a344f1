"""The supervisor's defaults that its command line shows and its process uses, in one place
(imported by `queryqueue --help` without loading the server)."""

from __future__ import annotations

# How long a stopping supervisor lets running queries finish before it ends their workers
# and gives their items back (pending again): under Docker's 10 s and Kubernetes' 30 s.
DEFAULT_STOP_GRACE = 5.0
