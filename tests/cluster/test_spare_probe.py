"""A spare takes a lost node's rank at once when the node's own host refuses its endpoint (its rlsup is gone),
and waits the whole ``spare_takeover_s`` for a node whose endpoint still accepts (slow, stopped or hung: its
socket is there). Real sockets and a real embedded store, in process."""

from __future__ import annotations




