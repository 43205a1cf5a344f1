"""The socket driver: a request process's or a worker's connection to the supervisor, one
`QueueDriver` among the others (`driver_sqlite`, `driver_postgres`), speaking the
supervisor's frame protocol over a Unix socket or authenticated loopback TCP."""

from queryqueue.driver_socket.client import SocketQueueDriver

__all__ = ["SocketQueueDriver"]
