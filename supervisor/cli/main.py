"""The ``rlsup`` command line: run, status, config, checkpoints, demo."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from rlsup_format.names import PLACEMENT_GLOB
from rlsup_format.state_files import REPLICATION, RUN_LOCK
from supervisor import __version__, exit_codes
from supervisor import log as rlsup_log
from supervisor.config import (ConfigError, SupervisorConfig, add_flags, load_config, node_membership,
                               reference_markdown, to_yaml)
from supervisor.run.incidents import read_incidents, read_state
from supervisor.observer import Observer

if TYPE_CHECKING:
    from supervisor.cluster.coordinator import RoundCoordinator
    from supervisor.job_identity import JobIdentity
    from supervisor.stop_request import StopRequest
    from supervisor.cluster.node_service import NodeService, NodeServiceSettings
    from supervisor.processes.layer import Processes
    from supervisor.launch.warm_start import WarmStarts

from supervisor.membership import Membership

log = logging.getLogger("supervisor.cli.main")  # not __name__: under `python -m` that is __main__

def _split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def cmd_run(args: argparse.Namespace, command: list[str]) -> int:
    from supervisor.cluster.dir_lock import DirInUse, DirLock
    from supervisor.run.loop import Supervisor

    if not command:
        log.error("no command given; usage: rlsup run [options] -- COMMAND [ARGS...]")
        return exit_codes.CONFIG_ERROR
    from supervisor.run.launch_args import LaunchArgError, check as check_placeholders

    try:
        check_placeholders(command)
    except LaunchArgError as e:
        raise ConfigError(f"launch command: {e}") from e
    eff = load_config(args)
    cfg = eff.config.resolved()
    membership = node_membership(eff)
    rlsup_log.configure(args.log_level, eff.config.log_format)
    rlsup_log.set_context(node=membership.node_rank if membership is not None else 0)  # n0: node 0 of 1
    job = identity_of(eff.config, membership)
    try:
        lock = DirLock(cfg.state_dir, RUN_LOCK, "state_dir", job.id).acquire()
    except DirInUse as e:
        _refused(cfg, membership, job, e)
        raise ConfigError(str(e)) from e
    try:
        observer = start_metrics(cfg)
        if membership is None:
            code = Supervisor(cfg, command, observer=observer, job=job).run().exit_code
        else:
            code = _run_multinode(cfg, command, membership, job, observer)
    finally:
        lock.release()
    _say_what_is_left(Path(cfg.state_dir), code)
    return code


#: What ``rlsup run`` left behind as it decided to exit (supervisor.diagnosis.unkillable.left_at_exit), for :func:`_end_run`.
_left: list[dict] = []
#: Once ``rlsup run`` has decided, its process is gone within this many seconds whatever its threads, atexit
#: handlers or executors wait on (they are abandoned; the exit code stays the decided one).
EXIT_DEADLINE_S = 5.0
#: What rlsup's last writes get before it exits anyway (a stalled stdout or stderr never holds the exit).
FLUSH_DEADLINE_S = 1.0


def _say_what_is_left(state_dir: Path, code: int) -> None:
    """Name (and record) what the run leaves: unkillable ranks, rlsup's forked calls stuck in a mount."""
    from supervisor.bounded_calls import left_behind
    from supervisor.diagnosis.unkillable import left_at_exit

    left = left_at_exit(state_dir, code, left_behind(), log.warning)
    if left is not None:
        _left.append(left)


def _end_run(code: int) -> None:
    """``rlsup run`` as a program has decided ``code``: its process ends now when it leaves something behind
    (its output flushed first, for at most :data:`FLUSH_DEADLINE_S`), else within :data:`EXIT_DEADLINE_S` of the
    interpreter's own exit (which joins non-daemon threads and executors and runs atexit handlers: any of them
    may wait on a hung mount). Either way the code reaches the caller (SLURM's step, the batch script), which a
    process held would never do. What ends it takes no lock and waits on no write: a stalled stdout or stderr
    (a reader that stopped reading) may be what holds the exit."""
    import threading

    def bounded(work: Callable[[], object], deadline: float) -> None:
        """``work()`` in a daemon thread given ``deadline``: a write blocked on a full pipe is left (os._exit
        ends it with the process)."""
        thread = threading.Thread(target=work, name="rlsup-exit-write", daemon=True)
        thread.start()
        thread.join(deadline)

    def flush() -> None:
        for handler in {h for name in ("", "supervisor", "rlsup") for h in logging.getLogger(name).handlers}:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001 - nothing may stop the exit
                pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass

    if _left:
        bounded(flush, FLUSH_DEADLINE_S)
        os._exit(code)
    stuck = [t.name for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]

    def deadline() -> None:
        time.sleep(EXIT_DEADLINE_S)
        text = (f"exit {code}: rlsup's exit waited {EXIT_DEADLINE_S:g}s (threads {', '.join(stuck) or 'none'}, "
                "atexit handlers): not waiting any longer")
        try:  # formatted as rlsup's lines are (a format takes no lock), written to fd 2 itself: no lock, no buffer
            handler = next(iter(logging.getLogger("supervisor").handlers))
            text = handler.format(logging.LogRecord(log.name, logging.WARNING, __file__, 0, text, None, None))
        except Exception:  # noqa: BLE001 - nothing may stop the exit
            text = f"rlsup: {text}"
        line = (text + "\n").encode(errors="replace")
        bounded(lambda: os.write(2, line), FLUSH_DEADLINE_S)
        os._exit(code)

    threading.Thread(target=deadline, name="rlsup-exit-deadline", daemon=True).start()


def _run_multinode(cfg: SupervisorConfig, command: list[str], membership: Membership, job: "JobIdentity",
                   observer: Observer | None) -> int:
    from supervisor.cluster.round_errors import CoordinationError, JobClash
    from supervisor.cluster.job_store import connect_coordinator
    from supervisor.cluster.node_run import NodeRun
    from supervisor.cluster.node_service import NodeServiceSettings, daemon_running
    from supervisor.launch.rank_pinning import PinningError
    from supervisor.run.settings import signal_named
    from supervisor.stop_request import StopRequest
    from supervisor.transport.auth import SecretError

    from supervisor.cluster.spare_run import SpareRun, SpareSettings
    from supervisor.cluster.spares import NodeRole, Roster, SlotTaken, SpareSeat

    service_settings = NodeServiceSettings.from_config(cfg)  # the replication service's part, built once
    # From here on a signal is a stop, never a kill: the run's one stop request, its handlers installed once for
    # the node's start-up, a spare's wait and the node's run alike.
    early = StopRequest(signal_named(cfg.preempt_signal))
    previous = early.install()

    def run_node(membership: Membership, seat: SpareSeat | None, hosted: "RoundCoordinator | None",
                 warm: "WarmStarts | None" = None, processes: "Processes | None" = None) -> int:
        rlsup_log.set_context(node=membership.node_rank)
        try:
            service = start_service(service_settings, membership, observer,
                                    serve=daemon_running(service_settings.state_dir) is None, job=job)
        except ConfigError as e:
            _refused(cfg, membership, job, e, early)
            raise
        asked_before = early.asked  # a stop before the run: see the drain below
        try:
            assert service.engine is not None
            node = NodeRun.from_config(cfg, command, membership, service.engine, observer, job=job,
                                       coordinator=hosted, stop=early, spares=seat, warm=warm, processes=processes,
                                       connect=None if hosted else lambda stop: connect_coordinator(
                                           cfg, membership, job, secret, stop))
            # Start-up is done and torch imported (torchrun's parser; the store's client): what exists now lives as
            # long as this process, so no full collection of the run walks it again, nor the exit's (~0.4 s of CPU)
            gc.collect()
            gc.freeze()
            return node.run().exit_code
        except SlotTaken as e:
            log.error("%s", e)
            return exit_codes.UNHEALTHY
        except (JobClash, PinningError) as e:
            log.error("%s", e)
            return exit_codes.CONFIG_ERROR
        except CoordinationError as e:
            log.error("%s", e)
            return exit_codes.FAILED
        finally:
            # A stop before the run or after it ends the last replication pass at once; one the run took does not.
            asks_at_end = early.asks
            service.stop(stopped=lambda: asked_before or early.asks > asks_at_end)

    try:
        try:
            secret = service_settings.security.secret()  # the store's keys are signed with it too
        except SecretError as e:  # a config error (exit 2) naming the key or the file, as the service's own check
            raise ConfigError(str(e)) from e
        if not cfg.spares:
            return run_node(membership, None, None)
        roster = Roster(membership.peers, cfg.spares)
        if roster.role(membership.node_rank) is NodeRole.WORKER:
            return run_node(roster.membership(membership.node_rank), SpareSeat(roster), None)
        spare_settings = SpareSettings.from_config(cfg, membership.node_rank, job.id)
        spare = SpareRun(spare_settings, roster, membership.node_rank, job, secret,
                         lambda view, stop, gone_after_s, wait_s: connect_coordinator(
                             cfg, view, job, secret, stop, gone_after_s, wait_s),
                         early, observer or Observer(), command)
        try:
            return spare.run(run_node)
        except CoordinationError as e:
            log.error("%s", e)
            return exit_codes.FAILED
    finally:
        early.restore(previous)


def _refused(cfg: SupervisorConfig, membership: Membership | None, job: "JobIdentity", clash: Exception,
             stop: "StopRequest | None" = None) -> None:
    """A node of several that refuses to start (a directory or port another job holds) tells its job's other
    nodes, so they end now instead of waiting for it (supervisor.cluster.clash_notice)."""
    if membership is not None:
        from supervisor.cluster.clash_notice import tell_job_refused
        from supervisor.cluster.job_store import CoordinatorSettings
        from supervisor.transport.security import TransportSecurity

        tell_job_refused(CoordinatorSettings.from_config(cfg), TransportSecurity.from_config(cfg), membership, job,
                         str(clash), stop)


def identity_of(raw: SupervisorConfig, membership: Membership | None) -> "JobIdentity":
    """The job's identity from the config as written (before paths are resolved) and the environment."""
    from supervisor.job_identity import job_identity

    peers = membership.peers if membership is not None else ()
    return job_identity(raw.job_name, raw.checkpoint_dir, membership is not None, peers=peers)


def start_service(settings: "NodeServiceSettings", membership: Membership, observer: Observer | None,
                  serve: bool, job: "JobIdentity") -> "NodeService":
    """The node's replication service; a missing or unsafe token file, a replica_dir or endpoint port
    another job holds, is a config error (exit 2) naming the clash."""
    from supervisor.cluster.dir_lock import DirInUse
    from supervisor.cluster.node_service import NodeService
    from supervisor.transport.auth import SecretError

    try:
        return NodeService(settings, membership, observer or Observer(), serve=serve, job=job).start()
    except (SecretError, ValueError, DirInUse) as e:
        raise ConfigError(str(e)) from e
    except OSError as e:  # the endpoint's port is taken, or a directory cannot be created
        raise ConfigError(f"replication endpoint {membership.me} (job {job.id}): {e}; another job on this host "
                          "may hold the port: give each job its own peers ports") from e


def cmd_daemon(args: argparse.Namespace) -> int:
    """The per-node service: replication endpoint and replicator, until SIGTERM (systemd, SLURM)."""
    import signal

    from supervisor.cli import sd_notify
    from supervisor.cluster.node_service import NodeServiceSettings
    from supervisor.stop_request import StopRequest

    eff = load_config(args)
    raw, cfg = eff.config, eff.config.resolved()
    membership = node_membership(eff, command="daemon")
    assert membership is not None  # node_membership refuses a daemon without peers
    rlsup_log.configure(args.log_level, raw.log_format)
    rlsup_log.set_context(node=membership.node_rank)
    job = identity_of(raw, membership)
    observer = start_metrics(cfg)
    # The handlers only assign (StopRequest.note): a handler that took a lock (Event.set) deadlocked when a
    # second signal landed inside the main thread's wait or inside the first handler.
    stop = StopRequest(signal.SIGTERM)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.note(signum))
    service = start_service(NodeServiceSettings.from_config(cfg), membership, observer, serve=True, job=job)
    service.write_daemon_file()
    sd_notify.ready()
    interval = sd_notify.watchdog_interval()
    ping_every = interval / 2 if interval else None
    last_ping = time.monotonic()
    try:
        # Short slices: a signal that lands on another thread runs its Python handler only when the main
        # thread wakes, so one long wait could sit on SIGTERM for as long as the wait lasts.
        slice_s = min(0.5, ping_every or 0.5)
        while not stop.wait(slice_s, slice_s):
            if ping_every is not None and time.monotonic() - last_ping >= ping_every:
                sd_notify.watchdog_ping()
                last_ping = time.monotonic()
    finally:
        sd_notify.notify("STOPPING=1")
        service.stop()
    return exit_codes.OK

def start_metrics(cfg: SupervisorConfig) -> Observer | None:
    """The /metrics endpoint; a busy port is reported and supervision goes on without it."""
    from supervisor.cli.metrics import MetricsSettings, SupervisorMetrics

    settings = MetricsSettings.from_config(cfg)
    if settings.port == 0:
        return None
    metrics = SupervisorMetrics(job=settings.job_name)
    try:
        port = metrics.serve(settings.addr, settings.port)
    except OSError as e:
        log.warning("metrics endpoint %s:%s not started: %s", settings.addr, settings.port, e)
        return None
    log.info("metrics on http://%s:%s/metrics", settings.addr, port)
    return metrics


def cmd_status(args: argparse.Namespace) -> int:
    eff = load_config(args)
    state_dir = Path(eff.config.state_dir)
    state = read_state(state_dir)
    incidents = read_incidents(state_dir, last=args.last)
    replication = read_replication(state_dir, Path(eff.config.checkpoint_dir))
    if args.json:
        print(json.dumps({"state_dir": str(state_dir.resolve()), "job": state, "incidents": incidents,
                          "replication": replication}, indent=1))
        return 0 if state else 1
    if state is None:
        print(f"no rlsup job state in {state_dir}")
        return 1
    age = time.time() - state.get("updated", time.time())
    print(f"job:       {state['state']} (attempt {state['attempt']}, rlsup pid {state['pid']}, updated {age:.0f}s ago)")
    print(f"command:   {' '.join(state['command'])}")
    if state.get("world_nodes") is not None and state.get("job_nodes") is not None:  # several nodes only
        shrunk = " (shrunk)" if state["world_nodes"] < state["job_nodes"] else ""
        print(f"nodes:     {state['world_nodes']} of {state['job_nodes']}{shrunk}")
    if state.get("last_step") is not None:
        print(f"last step: {state['last_step']}")
    if state.get("heartbeat_timeout_s") is not None:
        how = (state.get("heartbeat_timeout_origin") or {}).get("text")
        print(f"heartbeat timeout: {state['heartbeat_timeout_s']:.1f}s" + (f" ({how})" if how else ""))
    if state.get("resume_step") is not None:
        print(f"resumed from step {state['resume_step']} ({state['resume_dir']})")
    elif state.get("resume_dir"):
        print(f"resumed from {state['resume_dir']} (step unknown: the checkpoint does not name one)")
    if state.get("exit_code") is not None:
        print(f"exit code: {state['exit_code']}")
    if replication:
        print_replication(replication)
    print(f"incidents: {len(incidents)} shown")
    for inc in incidents:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(inc["time"]))
        extra = f" downtime {inc['downtime_s']:.1f}s" if inc.get("downtime_s") is not None else ""
        resumed = f" resumed step {inc['resumed_step']}" if inc.get("resumed_step") is not None else ""
        print(f"  {when} attempt {inc['attempt']}: {inc['reason']} {inc.get('detail', '')} -> {inc['action']}{extra}{resumed}")
        if inc.get("fr_verdict"):
            print(f"      {inc['fr_verdict']}")
        if inc.get("verdict"):
            print(f"      {inc['verdict']}")
    return 0


def read_replication(state_dir: Path, checkpoint_dir: Path) -> dict | None:
    """Replication progress per peer (from the engine's state file) and where each step's parts live."""
    try:
        data = json.loads((state_dir / REPLICATION).read_text())
    except (OSError, ValueError):
        return None
    placement = {}
    for path in sorted(checkpoint_dir.glob(f"step_*/{PLACEMENT_GLOB}")):
        try:
            p = json.loads(path.read_text())
            placement.setdefault(str(p["step"]), {})[str(p["owner"])] = p["peers"]
        except (OSError, ValueError, KeyError):
            continue
    data["placement"] = placement
    return data


def print_replication(rep: dict) -> None:
    print(f"replication: node {rep['node']} -> nodes {rep['targets']}")
    for peer, prog in sorted(rep.get("progress", {}).items()):
        err = f", last error: {prog['last_error']}" if prog.get("last_error") else ""
        print(f"  peer {peer} ({rep['peers'][int(peer)]}): {prog['bytes_sent']} bytes in {prog['parts_sent']} parts, "
              f"{prog['rate_bps'] / 1e6:.1f} MB/s, lag {prog['lag_s']:.1f}s, {prog['failures']} failures{err}")
    for step, owners in sorted(rep.get("placement", {}).items(), key=lambda kv: int(kv[0])):
        where = "; ".join(f"node {o} parts on {', '.join(peers) or 'no peer yet'}" for o, peers in owners.items())
        print(f"  step {step}: {where}")


def cmd_config(args: argparse.Namespace) -> int:
    if args.config_cmd == "reference":
        print(reference_markdown(), end="")
        return 0
    print(to_yaml(load_config(args)), end="")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The embedded default: a 2-rank torchrun trainer that crashes once and resumes under supervision."""
    import shlex

    from supervisor.run.loop import Supervisor

    script = Path(__file__).resolve().parents[2] / "examples" / "train_tiny.py"
    if not script.exists():
        log.error("demo: %s not found (run from a clone of the repository)", script)
        return exit_codes.CONFIG_ERROR
    workdir = Path(args.workdir).resolve()
    if workdir.exists():
        shutil.rmtree(workdir)
    # The demo's own values, validated with the rest (they win over flags and files, as they always did).
    demo = {"checkpoint_dir": str(workdir / "checkpoints"), "state_dir": str(workdir / "state"),
            "backoff_initial": 0.5, "heartbeat_timeout": 30.0}
    cfg = load_config(args, environ={}, overrides=demo, overrides_origin="rlsup demo").config
    rlsup_log.configure(args.log_level, cfg.log_format)
    rlsup_log.set_context(node=0)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(script), "--steps", str(args.steps), "--checkpoint-every", "5",
               "--crash-at-step", str(args.crash_at_step), "--out", str(workdir / "final_weights.pt")]
    print(f"[rlsup demo] supervising: {' '.join(command)}", flush=True)
    result = Supervisor(cfg, command, observer=start_metrics(cfg)).run()
    print(f"[rlsup demo] finished: {result.status.value}, {result.attempts} attempt(s), exit {result.exit_code}")
    for inc in result.incidents:
        # a resume only where a next attempt started (downtime known); after giving up nothing was resumed
        after = (f"resumed from step {inc.resumed_step} after {inc.downtime_s}s" if inc.downtime_s is not None
                 else f"{inc.action.value}, nothing resumed")
        print(f"[rlsup demo] incident: attempt {inc.attempt} {inc.reason} ({inc.detail}); {after}")
    hint = f"{this_rlsup()} status --state-dir {shlex.quote(str(cfg.state_dir))}"
    print(f"[rlsup demo] state: {cfg.state_dir} (try: {hint})")
    return result.exit_code


def this_rlsup() -> str:
    """How to run this rlsup again from here, as a shell word: ``rlsup`` where that names it on PATH, else
    the script as it was started (``.venv/bin/rlsup``, the README's way), else ``python -m supervisor.cli.main``."""
    import shlex

    argv0 = sys.argv[0]
    if os.path.basename(argv0) == "rlsup" and os.path.isfile(argv0):
        on_path = shutil.which("rlsup")
        if on_path and os.path.realpath(on_path) == os.path.realpath(argv0):
            return "rlsup"
        return shlex.quote(argv0)
    return f"{shlex.quote(sys.executable)} -m supervisor.cli.main"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlsup", description="Fault-tolerant training supervisor.")
    parser.add_argument("--version", action="version", version=f"rlsup {__version__}")
    parser.add_argument("--log-level", default=rlsup_log.DEFAULT_LEVEL, type=str.upper, choices=rlsup_log.LEVELS,
                        help="Level of rlsup's own lines on stderr, every component alike (default INFO).")
    sub = parser.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser("run", help="Run COMMAND under supervision: rlsup run [options] -- COMMAND...")
    add_flags(run)

    status = sub.add_parser("status", help="Show the job state and recent incidents.")
    add_flags(status)
    status.add_argument("--json", action="store_true", help="Machine-readable output.")
    status.add_argument("--last", type=int, default=20, help="How many incidents to show.")

    config = sub.add_parser("config", help="Show the effective config or the generated reference.")
    config_sub = config.add_subparsers(dest="config_cmd", required=True)
    add_flags(config_sub.add_parser("show", help="Print the effective config and where each value came from."))
    config_sub.add_parser("reference", help="Print the config reference (Markdown) generated from the code.")

    daemon = sub.add_parser("daemon", help="Per-node service: replication endpoint and replicator (systemd, SLURM).")
    add_flags(daemon)

    demo = sub.add_parser("demo", help="Supervised demo training that survives an injected crash.")
    add_flags(demo)
    demo.add_argument("--workdir", default="rlsup-demo", help="Directory for the demo's checkpoints and state.")
    for command in (run, daemon, demo, status):  # also after the subcommand: rlsup run --log-level DEBUG -- ...
        command.add_argument("--log-level", default=argparse.SUPPRESS, type=str.upper, choices=rlsup_log.LEVELS,
                             help="Level of rlsup's own lines on stderr (default INFO).")
    demo.add_argument("--steps", type=int, default=40)
    demo.add_argument("--crash-at-step", type=int, default=23)

    try:
        from supervisor.cli import checkpoints as checkpoints_cli
    except ImportError:
        pass
    else:
        checkpoints_cli.register(sub)
    from supervisor.cli import incidents as incidents_cli

    incidents_cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    program = argv is None  # main() as the program (rlsup, python -m supervisor.cli.main), not called in process
    argv = list(sys.argv[1:] if argv is None else argv)
    own, command = _split_command(argv)
    parser = build_parser()
    args = parser.parse_args(own)
    rlsup_log.configure(args.log_level)
    try:
        if args.cmd == "run":
            code = cmd_run(args, command)
            if program:  # an in-process caller's interpreter is never ended here
                _end_run(code)
            return code
        if command:
            parser.error(f"'--' and a command are only for 'rlsup run', not '{args.cmd}'")
        if args.cmd == "status":
            return cmd_status(args)
        if args.cmd == "config":
            return cmd_config(args)
        if args.cmd == "demo":
            return cmd_demo(args)
        if args.cmd == "daemon":
            return cmd_daemon(args)
        return int(args.func(args))
    except ConfigError as e:
        log.error("config error: %s", e)
        return exit_codes.CONFIG_ERROR


if __name__ == "__main__":
    sys.exit(main())
