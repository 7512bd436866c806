"""The words the config shares with the components it configures: choice names, and values its help quotes.

Here, below both, so that the config (:mod:`supervisor.config`) imports no component: a component that dispatches
on a name takes its type from here (the straggler actions, the coordination stores), and where a component keeps
its own catalogue (the checkpoint layouts, the progress presets) the names are written here once more and
tests/shared/test_config_choices.py keeps the two equal, in order. Standard library only.
"""

from __future__ import annotations

import re
from typing import Literal

#: ``checkpoint_layout``: the layout catalogue's names (:data:`supervisor.layouts.LAYOUTS`, in its order) ...
CATALOGUE_LAYOUTS = ("rlsup", "verl", "verl-legacy", "megatron", "areal", "nemo-rl", "nemo", "hf", "deepspeed",
                     "lightning", "torchtitan", "dcp")
#: ... and the single-file layout's (:data:`supervisor.layouts.single_file.NAME`), which is not in the catalogue.
SINGLE_FILE_LAYOUT = "single-file"
#: ``progress``: the presets' names (:data:`supervisor.diagnosis.step_reports.PRESETS`, in its order).
PROGRESS_PRESETS = ("verl", "areal", "megatron-bridge", "hf", "nanogpt", "lightning")
#: ``straggler_action``: report a straggler (log, stragglers.jsonl, metric) or also end the attempt like a hang
#: (:class:`supervisor.diagnosis.stragglers.StragglerWatch` ``restart``).
StragglerAction = Literal["report", "restart"]
#: ``coordinator_backend``: the stores by name: ``embedded``, the store node 0's supervisor hosts
#: (:class:`supervisor.cluster.kvstore.EmbeddedKVStore`), or ``etcd`` (:mod:`supervisor.cluster.kvstore_etcd`).
CoordinatorBackend = Literal["embedded", "etcd"]
#: An endpoint refused without a break this long: its rlsup is gone (:mod:`supervisor.cluster.endpoint_probe`;
#: ``spare_takeover_s``'s help quotes it).
REFUSED_FOR_S = 0.5


def step_pattern(regex: str) -> re.Pattern[str]:
    """A progress regex (``progress_regex``, or a preset's) compiled; ValueError saying what is wrong with it."""
    try:
        pattern = re.compile(regex)
    except re.error as e:
        raise ValueError(f"not a regular expression: {e}") from None
    if pattern.groups < 1:
        raise ValueError("needs a group around the step number, e.g. 'step (\\d+)'")
    return pattern
