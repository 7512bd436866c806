"""The run loop's one collaborator for the job's other nodes (:class:`Peers`), and the one a single node has.

The loop (:mod:`supervisor.run.loop`) asks its peers at each step of an attempt that involves other nodes: the
attempt number they agree on, the resume point they agree on, whether another node ended the attempt, and it
tells them when this node's attempt failed or it gives up. On one node, :class:`SingleNode` answers with this
node's own view; the multi-node implementation is :class:`supervisor.cluster.multinode.NodeGroup` (passed in, as
torch elastic passes its rendezvous handler to the agent: nothing of the loop is overridden).
"""

from __future__ import annotations

from dataclasses import dataclass

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

from supervisor.diagnosis.evidence import EndedElsewhere, FlightEvidence
from supervisor.diagnosis.outcome import AttemptResult
from supervisor.tiers.resume import ResumePoint

if TYPE_CHECKING:
    from supervisor.diagnosis.flight_recorder import Analysis


class FlightRecordShare(Protocol):
    """Where a hang's Flight Recorder dumps meet when the job has several nodes, as the watch of an attempt
    (:class:`supervisor.run.attempt_watch.AttemptWatch` ``fr_share``) uses it: node 0 judges every node's dumps.
    :class:`supervisor.cluster.fr_exchange.FrExchange` (a layer above, passed in); no method raises."""

    def hang(self, attempt: int, flight: "Analysis | None") -> None:
        """This node saw the hang and took its ranks' dumps (``flight``): ask for everyone's, publish ours."""

    def end(self, attempt: int, why: str) -> None:
        """End the attempt for every node, after this node's stacks and before its kill."""

    def await_peers(self, attempt: int) -> None:
        """Until every node's dumps are there (bounded; not once rlsup is asked to stop), before the kill."""

    def peer_ended(self, attempt: int, hb_dir: Path, ranks: Iterable[int]) -> None:
        """Another node ended the attempt: where it asked for dumps, take and publish this node's."""

    def settle(self, attempt: int, attempt_dir: Path | None = None) -> FlightEvidence | None:
        """The verdict across nodes for a failed attempt, where dumps were asked for (None: none, or none came)."""


@dataclass(frozen=True)
class World:
    """The nodes that run an agreed attempt, of the job's; ``change``: what its round did to the job's size, in the
    words the log and the incident use ("continued on 2 of 3 nodes from step 6", "grew back to 3 at step 9"; "":
    nothing)."""

    nodes: int
    job_nodes: int
    change: str = ""


class Peers(Protocol):
    """The other nodes of the job, as one node's run loop sees them."""

    @property
    def size(self) -> int:
        """Nodes in the job (1: this node alone)."""

    @property
    def flight_records(self) -> FlightRecordShare | None:
        """Where a hang's Flight Recorder dumps are shared with the other nodes (the watch's ``fr_share``);
        None on one node."""

    def join(self, mine: int) -> int:
        """The attempt every node runs next; ``mine``: the one this node would run on its own."""

    def agree(self, attempt: int, own_choice: Callable[[], ResumePoint | None]) -> ResumePoint | None:
        """The resume point every node starts ``attempt`` from (``own_choice``: this node's own choice);
        :class:`supervisor.run.loop.AttemptAbandoned` when the attempt is over before launch."""

    def peer_ended(self, attempt: int, grow: bool = True) -> EndedElsewhere | None:
        """Polled while the job runs: another node ended ``attempt`` (``peer_failure``; ``resized`` when node 0
        ended it to grow the job back), or None. ``grow``: node 0 may end it now to grow back (not once its own
        job ended: a failure of its own is never passed off as a grow)."""

    def attempt_succeeded(self, attempt: int) -> EndedElsewhere | None:
        """This node's ranks all finished: the attempt's one end, as the job's nodes agree on it. None: the success
        stands; ``resized``: node 0 ended the attempt to grow the job back at that same save (the job's last) first,
        and this node goes on to the grown world with the others (which resumes from that save and ends at once)."""

    def attempt_failed(self, attempt: int, result: AttemptResult) -> None:
        """This node's attempt failed: the other nodes are told (before the incident is recorded)."""

    def give_up(self, reason: str) -> None:
        """This node stops restarting: the other nodes are told."""

    def progress_marker(self, own_marker: Callable[[], int | None]) -> int | None:
        """The newest valid checkpoint step this node's progress is judged by (``own_marker``: one node's rule)."""

    def env(self) -> dict[str, str]:
        """What every attempt's environment adds for the job's nodes (none on a single node)."""

    def world(self) -> World | None:
        """The nodes that run the agreed attempt: fewer after a shrink; None on a single node."""

    def command(self, argv: list[str]) -> list[str]:
        """The attempt's launch line as the job's nodes run it now (the launcher's node count and node rank after
        the job shrank or grew back); ``argv`` unchanged on a single node."""


class SingleNode:
    """A job of one node: nobody to agree with, nobody to tell."""

    size = 1
    flight_records = None

    def join(self, mine: int) -> int:
        return mine

    def agree(self, attempt: int, own_choice: Callable[[], ResumePoint | None]) -> ResumePoint | None:
        return own_choice()

    def peer_ended(self, attempt: int, grow: bool = True) -> EndedElsewhere | None:
        return None

    def attempt_succeeded(self, attempt: int) -> EndedElsewhere | None:
        return None

    def attempt_failed(self, attempt: int, result: AttemptResult) -> None:
        pass

    def give_up(self, reason: str) -> None:
        pass

    def progress_marker(self, own_marker: Callable[[], int | None]) -> int | None:
        return own_marker()

    def env(self) -> dict[str, str]:
        return {}

    def world(self) -> World | None:
        return None

    def command(self, argv: list[str]) -> list[str]:
        return argv


__all__ = ["Peers", "SingleNode", "World"]
