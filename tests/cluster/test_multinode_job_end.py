"""A finished job stays finished (issue 41, item 7): a node cut off until after its job ended, its rank run to the
end by a spare, comes back to a store gone with the job. It learns that the job finished (node 0's record,
:class:`supervisor.cluster.spares.JobEnd`) and exits 0, never 75 (a requeue of a job that succeeded).

The record's rules are tested here in process (fast); the scenario end to end with real nodes (3 job nodes of 2
ranks and 1 spare on 127.0.0.1, node 2's rlsup and everything under it SIGSTOPped until the others are done) is
:func:`test_a_node_cut_off_until_after_the_job_finished_exits_0`. What the batch script answers beside it is
tests/deploy/test_sbatch_spares.py."""

from __future__ import annotations

import time
from pathlib import Path


from supervisor.job_identity import JobIdentity
from supervisor.cluster.spares import (JobEnd, JobEndLookout, job_end_name, job_end_places,
                               write_job_end)

JOB = JobIdentity("job-end-test", "test")
SECRET = b"s3cret-shared-by-all-nodes"


def lookout(places: tuple[Path, ...], since: float, secret: bytes = SECRET) -> JobEndLookout:
    return JobEndLookout(places, JOB, secret, since, every_s=0.0)


def test_the_record_is_found_in_any_place_and_only_when_it_is_this_run_s(tmp_path: Path) -> None:
    checkpoints, persistent = tmp_path / "ckpt", tmp_path / "persistent" / JOB.id
    places = job_end_places(checkpoints, persistent)
    started = time.time()
    assert lookout(places, started).look() is None  # nothing written: the store may come back, go on waiting
    end = JobEnd(JOB.id, 0, 3, started + 1)
    assert write_job_end((persistent,), end, SECRET, JOB) == []
    assert lookout(places, started).look() == end  # the persistent tier alone is enough
    assert lookout(places, started + 2).look() is None  # older than this node's start: an earlier run's
    assert lookout(places, started, b"another job's secret").look() is None  # not signed with this job's secret
    other = JobIdentity("another-job", "test")
    assert JobEndLookout(places, other, SECRET, started, every_s=0.0).look() is None  # another job's name, file
    (checkpoints / job_end_name(JOB)).parent.mkdir(parents=True)
    (checkpoints / job_end_name(JOB)).write_bytes(b'{"body": "torn')  # a torn copy in one place: the other counts
    assert lookout(places, started).look() == end


def test_a_forged_record_is_refused(tmp_path: Path) -> None:
    end = JobEnd(JOB.id, 0, 3, time.time() + 1)
    raw = end.seal(SECRET).replace(b'\\"attempt\\": 3', b'\\"attempt\\": 4')
    assert raw != end.seal(SECRET)
    assert JobEnd.open(raw, JOB, SECRET) is None and JobEnd.open(end.seal(SECRET), JOB, SECRET) == end


