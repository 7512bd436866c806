"""Randomised chaos soak: ``cd tests && python -m chaos.soak --minutes 30 [--seed N] [--out summary.json]``.

Each iteration picks a scenario and a seed from the master seed (printed first); a failing iteration
prints its scenario and seed, and is replayed with ``--replay SCENARIO:SEED``.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from . import scenarios as S
from . import scenarios_multinode as MN
from . import scenarios_tiers as T

WEIGHTS = {"kill-w1": 6, "kill-w2": 2, "corruption": 1, "disk_full": 1, "replica_disk_full": 1, "clock_jump": 1,
           "hostile_peer": 1, "hostile_client": 1, "bad_config": 1, "async-w1": 2, "async-w2": 1, "persistent": 2,
           "mn_transfer": 1, "mn_fetch": 1}


def run_one(name: str, seed: int, work: Path, ref_cache: Path) -> S.ScenarioResult:
    rng = random.Random(seed)
    if name.startswith("kill"):
        world = 2 if name == "kill-w2" else 1
        return S.kill_scenario(work, ref_cache, seed, world, n_faults=rng.randint(3, 6), name="kill",
                              require_injected=False)
    if name == "corruption":
        return S.corruption_scenario(work, ref_cache, seed, n_damaged=rng.randint(1, 4))
    if name == "disk_full":
        # 7 MB holds keep_last=2 steps of ~2.3 MB plus a staging copy: the disk never fills (seed 1500060119)
        return S.disk_full_scenario(work, ref_cache, seed, size_mb=rng.choice([5, 6]))
    if name == "replica_disk_full":
        return S.replica_disk_full_scenario(work, seed)
    if name == "clock_jump":
        return S.clock_jump_scenario(work, ref_cache, seed)
    if name == "hostile_peer":
        from .hostile import PEER_MODES

        modes = tuple(rng.sample([m for m in PEER_MODES if m != "slow_drip"], 4))
        return S.hostile_peer_scenario(work, seed, modes)
    if name == "hostile_client":
        return S.hostile_client_scenario(work, seed)
    if name == "bad_config":
        return S.bad_config_scenario(work, seed, n_random=200)
    if name.startswith("async"):
        world = 2 if name == "async-w2" else 1
        return T.async_write_scenario(work, ref_cache, seed, world, n_faults=rng.randint(2, 5), require_injected=False)
    if name == "persistent":
        return T.persistent_copy_scenario(work, ref_cache, seed, n_faults=rng.randint(1, 3),
                                          require_injected=False)
    if name == "mn_transfer":
        return MN.transfer_kill_scenario(work, seed)
    if name == "mn_fetch":
        return MN.fetch_kill_scenario(work, ref_cache, seed, kills=rng.randint(1, 2))
    raise ValueError(name)


def run_soak(minutes: float, root: Path, seed: int | None = None, out: Path | None = None,
             replay: str | None = None) -> dict:
    seed = seed if seed is not None else random.SystemRandom().randrange(1 << 31)
    print(f"[soak] master seed {seed} ({minutes} min); replay one iteration with --replay SCENARIO:SEED", flush=True)
    rng = random.Random(seed)
    ref_cache = root / "reference"
    deadline = time.monotonic() + minutes * 60
    faults: collections.Counter = collections.Counter()
    missed: collections.Counter = collections.Counter()
    per_scenario: collections.Counter = collections.Counter()
    totals = {"iterations": 0, "restarts": 0, "steps_lost": 0, "invariant_checks": 0, "skipped": 0}
    failures, notes = [], set()
    i = 0
    while time.monotonic() < deadline or (replay and i == 0):
        if replay:
            name, _, s = replay.partition(":")
            it_seed = int(s)
        else:
            name = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
            it_seed = rng.randrange(1 << 31)
        work = root / f"it{i:04d}-{name}"
        res = run_one(name, it_seed, work, ref_cache)
        i += 1
        print(f"[soak] #{i} {res.summary()}", flush=True)
        if any(p.startswith("SKIP:") for p in res.problems):
            totals["skipped"] += 1
            notes.add(f"{name}: {res.problems[0]}")
            continue
        totals["iterations"] += 1
        per_scenario[name] += 1
        totals["restarts"] += res.restarts
        totals["steps_lost"] += res.steps_lost
        totals["invariant_checks"] += res.invariant_checks
        for f in res.faults:
            if f.injected:
                faults[f"{f.kind}@{f.moment}" if f.kind in ("rank_kill", "rank_stop", "supervisor_kill", "node_kill",
                                                            "supervisor_stop", "writer_kill", "daemon_kill")
                       else f.kind] += 1
                if not f.hit and f.moment != "random":
                    missed[f"{f.kind}@{f.moment}"] += 1
            if f.note and "no overall deadline" in f.note:
                notes.add(f.note.split(" (")[0])
        if res.problems:
            failures.append({"scenario": name, "seed": it_seed, "problems": res.problems, "log": res.log[-4000:]})
            print(f"[soak] FAILED {name}:{it_seed}\n  " + "\n  ".join(res.problems), flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
        if replay:
            break
    summary = {"master_seed": seed, "minutes": minutes, **totals, "per_scenario": dict(per_scenario),
               "faults_injected": dict(sorted(faults.items())), "moments_missed_fell_back_to_random": dict(missed),
               "failures": failures, "notes": sorted(notes)}
    print("[soak] summary " + json.dumps({k: v for k, v in summary.items() if k != "failures"}, indent=1), flush=True)
    print(f"[soak] {len(failures)} failing iteration(s)", flush=True)
    if out is not None:
        out.write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=None, help="master seed (default: random, printed)")
    p.add_argument("--replay", default=None, metavar="SCENARIO:SEED", help="run one iteration again")
    p.add_argument("--workdir", default=None, help="where sandboxes go (default: a fresh temp dir)")
    p.add_argument("--out", default=None, help="write the JSON summary here")
    args = p.parse_args(argv)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="rlsup-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    summary = run_soak(args.minutes, root, args.seed, Path(args.out) if args.out else None, args.replay)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
