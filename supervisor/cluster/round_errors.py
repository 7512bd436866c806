"""Why a round of the job's nodes did not agree (:mod:`supervisor.cluster.coordinator`), one error each, so every
caller (the node's wiring, the spares, the exit codes) tells a requeue from a clash from an ended attempt."""

from __future__ import annotations

from supervisor.cluster.signed_keys import AbortKind, AbortNotice
from supervisor.lifecycle import EndReason


class CoordinationError(RuntimeError):
    """The nodes could not agree in time (a node missing, the store unreachable)."""


class RoundEnded(CoordinationError):
    """The attempt ended (a node failed, or a replacement node rejoined) while this node waited inside it;
    ``reason``: ``resized`` when node 0 ended it to grow the job back (:meth:`RoundCoordinator.end_to_resize`)."""

    def __init__(self, why: str, reason: EndReason = EndReason.PEER_FAILURE) -> None:
        super().__init__(why)
        self.reason = reason


class JobClash(CoordinationError):
    """The coordination store belongs to another job (same hosts and port): this node must not join it.
    Also raised on the nodes of a job one of whose nodes refused to start for a clash (``abort``)."""


class NodeZeroRunning(JobClash):
    """Node 0's coordinator port is held by a store of this same job: another node 0 hosts it (this one running
    twice, or a spare that took node rank 0 while this one was away: the caller tells them apart)."""


class NodesMissing(CoordinationError):
    """After the job's first attempt, a round waited ``rendezvous_timeout`` for nodes that did not come (lost, no
    spare left, too few for ``min_nodes`` or saves that cannot be resized): every node ends with exit 75 for a
    requeue; every checkpoint stays as it is."""


class PeerLost(CoordinationError):
    """A node of the job died (or was cut off) after reaching the store and before the job's first attempt
    (:mod:`supervisor.cluster.liveness`): every node ends, with exit 75 for a requeue."""


def aborted(notice: AbortNotice) -> CoordinationError:
    """What a node raises on the job's ``abort``: by its kind, the exit code every node ends with."""
    kinds: dict[AbortKind, type[CoordinationError]] = {AbortKind.CLASH: JobClash, AbortKind.PEER_LOST: PeerLost}
    return kinds.get(notice.kind, CoordinationError)(f"the job was aborted: {notice.why}")


__all__ = ["CoordinationError", "RoundEnded", "JobClash", "NodeZeroRunning", "NodesMissing", "PeerLost", "aborted"]
