"""The client's exceptions: one root, a branch per way a call can fail."""

from __future__ import annotations


class KestrelClientError(Exception):
    """Root of every error the client raises."""


class ServerUnavailable(KestrelClientError, ConnectionError):
    """Raised when a server cannot be reached or the connection broke during a call.

    `maybe_done` is true when the request was sent and its answer lost (a time-out, a connection
    broken mid-call): the server may have carried the call out. False when it never got there."""

    def __init__(self, address: str, reason: str, maybe_done: bool = False) -> None:
        super().__init__(f"kestrel {address}: {reason}")
        self.address = address
        self.reason = reason
        self.maybe_done = maybe_done


class ServerClosing(ServerUnavailable):
    """Raised when a server answered that the queue is closed: it is shutting down (a server closes
    its queues before its listeners), so the call belongs on another server, or on this one once it
    is back."""

    def __init__(self, address: str, message: str) -> None:
        super().__init__(address, f"shutting down ({message})")
        self.message = message


class Refused(KestrelClientError):
    """Raised when a server answered with an error: its status, a bad queue name, a limit.

    `by_status` is true when the server refused because of its status (read-only, quiescent): a
    state of the server, not of the call, so a Cluster tries that server last for a while.
    """

    def __init__(self, address: str, message: str) -> None:
        super().__init__(f"kestrel {address} refused: {message}")
        self.address = address
        self.message = message
        self.by_status = " refused: server is " in message


class NoServers(KestrelClientError):
    """Raised when no server of the set could take the call; `errors` holds each server's failure."""

    def __init__(self, what: str, errors: list[KestrelClientError] | None = None) -> None:
        self.errors = list(errors or [])
        detail = "; ".join(str(e) for e in self.errors) if self.errors else "the server set is empty"
        super().__init__(f"no kestrel server could {what}: {detail}")


class ClientClosed(KestrelClientError):
    """Raised by every call on a Cluster or Server after its `close()`: closing is final, so a
    call never quietly opens connections that nothing will close again."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what}: the client is closed")


class ServerSetsUnavailable(KestrelClientError):
    """Raised when the ZooKeeper ensemble holding the server sets cannot be reached at start, or
    refuses to show them."""


def refusal(address: str, message: str) -> KestrelClientError:
    """The error for a server's error reply: ServerClosing for a closed queue, else Refused.

    Kestrel answers a call on a queue it has closed (during shutdown) with "queue 'name' is
    closed"; that is a server going away, not a refusal of the call itself.
    """
    if message.endswith(" is closed"):
        return ServerClosing(address, message)
    return Refused(address, message)
