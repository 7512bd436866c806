"""The suite's fixtures and its two tiers (the ``e2e`` marker); the helpers tests share live in tests/support/."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from support.env import JOBS, ROOT, TESTS, clean_env
from support.incidents import incidents
from support.netns import enter_own_network_namespace
from support.ports import free_ports
from support.procs import pid_alive, rlsup_cmd, run_rlsup, start_rlsup
from support.waits import wait_for

# Test modules import helpers from tests/support (``from support.procs import run_rlsup``); these names stay
# importable from conftest only for modules written before it existed, until they import from support too.
__all__ = ["JOBS", "ROOT", "clean_env", "free_ports", "incidents", "pid_alive", "rlsup_cmd", "run_rlsup",
           "start_rlsup", "wait_for"]


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (the suite's command: ``-n 3``) each worker gets a loopback of its own, so tests that
    use rlsup's fixed default ports, as users do, never meet another worker's run."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        why_not = enter_own_network_namespace()
        if why_not:
            config.issue_config_time_warning(pytest.PytestWarning(
                f"worker {os.environ['PYTEST_XDIST_WORKER']} shares the host's loopback ({why_not}): tests on "
                "fixed default ports may meet another worker's; run without -n, or as root"), stacklevel=2)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # xdist would hand out modules by test count: see LONGEST_FIRST


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


# ---- the two tiers ----
# The fast tier is what runs in this process: the run loop over the fake process layer, policy tables, config,
# formats, the part protocol, layouts on built trees (`pytest -m "not e2e"`, under a minute). Everything else is
# the end-to-end tier, marked `e2e` here: it starts rlsup, torchrun, trainers, servers or other processes.
# The list names the fast modules, so a new module is end-to-end until it is listed: a test that starts processes
# can never slow the fast tier by being forgotten. Under a fast module, what in it is end-to-end all the same: a test
# (all its parameters), a parameter (`[etcd]`: every test with that id), or a fixture that starts real runs (every
# test using it): whatever starts rlsup itself, or needs other real processes or waits on real time for more than
# about a second (a short `python -c` or promtool check stays fast).
FAST_MODULES: dict[str, frozenset[str]] = {
    "test_architecture_doc.py": frozenset(),
    "test_async_save.py": frozenset({"test_save_returns_before_the_write_and_the_copy_is_a_snapshot",  # writer
                                     "test_busy_skip_wait_and_writer_killed", "test_atexit_and_preemption_flush",
                                     "test_sigkill_trainer_or_writer_never_leaves_a_valid_partial"}),
    "test_attempt_end.py": frozenset(),
    "test_backends.py": frozenset(),
    "test_bench_node_loss.py": frozenset(),
    "test_builtin_check.py": frozenset({"test_rlsup_run_with_the_builtin_check_says_no_gpus_and_runs_the_job"}),
    "test_checkpoint_manager.py": frozenset({"test_sigkill_at_random_moments_never_loses_a_valid_checkpoint",
                                             "test_full_disk_save_error_says_no_space"}),
    "test_config.py": frozenset({"test_replication_settings_errors_exit_2"}),  # a real rlsup daemon
    "test_config_choices.py": frozenset(),
    "test_control_records.py": frozenset(),
    "test_coordination_stop.py": frozenset(),
    "test_coordinator.py": frozenset(),
    "test_deploy_grafana.py": frozenset({"test_metric_names_exist_in_a_real_scrape"}),  # scrapes real runs
    "test_deploy_jobset.py": frozenset(),
    "test_deploy_prometheus.py": frozenset({"test_rules_read_only_exported_series"}),  # scrapes real runs
    "test_deploy_systemd.py": frozenset(),
    "test_format.py": frozenset(),
    "test_flight_recorder_analysis.py": frozenset(),  # starts a thread, not a process
    "test_fr_exchange_waits.py": frozenset({"test_the_analysers_child_is_killed_when_rlsup_is_asked_to_stop",
                                            "test_a_chatty_analyser_is_drained_while_it_is_awaited"}),
    "test_fr_records.py": frozenset(),  # a real TCPStore in process, torch's analyser in process
    "test_gateway_client.py": frozenset(),
    "test_gpu_failures.py": frozenset(),
    "test_hang_detector.py": frozenset(),
    "test_house_rules.py": frozenset(),
    "test_http11.py": frozenset(),
    "test_import_side_effects.py": frozenset(),
    "test_kvstore.py": frozenset({"[etcd]", "etcd_cluster", "etcd_cluster_clean"}),  # real etcd servers
    "test_launch_args.py": frozenset({  # rlsup run around a trainer that picks its newest step itself
        "test_torn_newest_step_under_a_trainer_that_picks_it_is_named_with_both_remedies",
        "test_with_quarantine_invalid_the_trainer_picking_latest_finishes",
        "test_with_the_placeholder_the_trainer_loads_rlsups_choice_and_finishes"}),
    "test_layouts_areal.py": frozenset(),
    "test_layouts_dcp.py": frozenset(),
    "test_layouts_deepspeed.py": frozenset({"real"}),  # the real DeepSpeed runs (module fixture)
    "test_layouts_hf.py": frozenset({"recorded"}),  # a real HF Trainer run, recorded (module fixture)
    "test_layouts_lightning.py": frozenset({"matrix"}),  # real Lightning runs killed at every write
    "test_layouts_megatron.py": frozenset({"test_run_with_no_megatron_tracker_claims_no_resume"}),
    "test_layouts_nemo.py": frozenset({"test_rlsup_run_resumes_from_the_newest_complete_step",
                                       "test_real_sigkill_leaves_what_the_in_process_stop_leaves"}),
    "test_layouts_nemo_rl.py": frozenset({"test_rlsup_run_resumes_from_the_newest_complete_step",
                                          "test_real_sigkill_leaves_what_the_in_process_stop_leaves"}),
    "test_layouts_rlsup.py": frozenset(),
    "test_layouts_torchtitan.py": frozenset({"test_rlsup_run_resumes_from_the_newest_complete_step",
                                             "test_real_sigkill_leaves_what_the_in_process_stop_leaves"}),
    "test_layouts_trainers_cli.py": frozenset({"test_cli_and_restart_selection_agree_on_the_newest_complete_step"}),
    "test_layouts_verl.py": frozenset(),
    "test_lifecycle.py": frozenset(),
    "test_log_lines.py": frozenset(),
    "test_logging.py": frozenset({"test_persistent_tier_line_reaches_rlsup_stderr",
                                  "test_rlsup_logging_between_the_jobs_text_and_newline_never_cuts_a_line"}),
    "test_manifest.py": frozenset(),
    "test_memory_tier.py": frozenset({"test_rank_sigkill_resumes_from_memory_bit_identical_and_success_removes_the_dir",
                                      "test_rlsup_sigkilled_successor_resumes_from_memory_bit_identical",
                                      "test_memory_too_small_saves_to_disk_with_a_clear_message_bit_identical",
                                      "test_stopped_run_drains_to_disk_and_keeps_the_memory_dir",
                                      "test_async_save_goes_to_the_memory_tier",
                                      "test_multi_node_memory_tier_refuses_a_time_cadence"}),
    "test_membership.py": frozenset(),
    "test_multinode_loop.py": frozenset(),
    "test_multinode_memory.py": frozenset({
        "test_rank_sigkill_all_nodes_resume_from_memory_bit_identical",
        "test_node_lost_with_its_memory_resumes_from_disk_and_a_peer_bit_identical"}),
    "test_outcome.py": frozenset(),
    "test_part_protocol.py": frozenset(),
    "test_persistent_tier.py": frozenset({"test_wiped_local_resumes_from_persistent_bit_identical"}),
    "test_private_files.py": frozenset(),
    "test_proc_children.py": frozenset(),
    "test_progress_rule.py": frozenset(),
    "test_progress.py": frozenset({"test_frozen_unmodified_trainer_is_a_hang_with_stacks",
                                   "test_rank_heartbeats_take_precedence_over_output",
                                   "test_unmodified_trainers_step_reaches_metrics_and_status",
                                   "test_no_progress_guard_stops_an_unmodified_trainer_that_hangs_at_the_same_point",
                                   "test_a_launcher_that_exits_1_after_the_last_step_is_not_restarted",
                                   "test_a_bar_redrawn_at_a_stuck_step_is_caught_as_a_hang",
                                   "test_bad_progress_config_is_refused"}),
    "test_rank_deaths.py": frozenset(),  # real processes, but short ones (a pidfd needs a real child)
    "test_rank_pinning.py": frozenset(),
    "test_replication_drain.py": frozenset(),
    "test_restart_policy.py": frozenset(),
    "test_run_loop.py": frozenset(),
    "test_sampler.py": frozenset(),
    "test_sd_notify.py": frozenset({"test_rlsup_daemon_speaks_the_protocol"}),
    "test_settings.py": frozenset(),
    "test_single_file.py": frozenset(),
    "test_spares_claims.py": frozenset(),
    "test_multinode_job_end.py": frozenset({  # a store's loss waited out (10 s); real nodes (a spare scenario)
        "test_a_join_waiting_for_a_lost_store_ends_when_the_job_s_end_is_found",
        "test_a_node_cut_off_until_after_the_job_finished_exits_0"}),
    "test_spare_probe.py": frozenset({  # each waits out a real takeover window (1.2-1.5 s)
        "test_a_missing_node_whose_endpoint_accepts_waits_for_the_window",
        "test_a_node_back_in_a_round_is_judged_afresh_in_the_next",
        "test_a_spare_that_just_claimed_a_rank_is_not_taken_for_gone"}),
    "test_node0_back_after_spare.py": frozenset(),
    "test_step_writer.py": frozenset(),
    "test_verify_once.py": frozenset(),
    "test_stragglers.py": frozenset({"test_four_rank_job_with_a_3x_slow_rank_is_reported",
                                     "test_straggler_alert_fires_in_a_real_prometheus"}),
    "test_direct_save.py": frozenset({"test_writer_killed_while_it_builds_a_direct_step_never_leaves_a_valid_torn_one"}),
    "test_first_round_liveness.py": frozenset({  # waits out a real lapse (5 s)
        "test_node_0_lost_in_the_first_round_ends_the_reconnect_wait_within_the_lapse"}),
    "test_first_round_requeue.py": frozenset({"etcd_cluster_clean"}),  # a real etcd server
    "test_manifest_watch.py": frozenset(),
    "test_memory_tier_timeline.py": frozenset(),
    "test_recovery_accounting.py": frozenset(),
    "test_sbatch_spares.py": frozenset(),
    "test_module_times.py": frozenset(),
    "test_node_name.py": frozenset(),
    "test_tier_metrics.py": frozenset({"test_a_read_that_moves_is_not_cut_one_that_stops_is"}),  # real stalls (4 s)
    "test_transport_auth.py": frozenset(),
    "test_transport_store.py": frozenset(),
    "test_unkillable.py": frozenset({  # real deadlines passing, 14 s and 2 s
        "test_calls_as_long_as_the_deadline_never_leave_it_blocked", "test_a_new_pass_after_a_stalled_one_is_not_stuck"}),
    "test_unreadable_checkpoints.py": frozenset(),
}


def _module(item: pytest.Item) -> str | None:
    """The item's file relative to tests/ (``chaos/test_chaos_ci.py``), None for a file outside tests/."""
    path = Path(str(item.path))
    return path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else None


def _is_e2e(item: pytest.Item) -> bool:
    module = _module(item)
    if module is None:
        return False
    if module not in FAST_MODULES:
        return True
    names = FAST_MODULES[module]
    if getattr(item, "originalname", item.name) in names or not names.isdisjoint(getattr(item, "fixturenames", ())):
        return True
    return any(n.startswith("[") and item.name.endswith(n) for n in names)


def _check_fast_modules(items: list[pytest.Item]) -> None:
    """A renamed test, fixture or module must not leave a stale name behind (a renamed slow test would join the
    fast tier)."""
    missing = [m for m in FAST_MODULES if not (TESTS / m).is_file()]
    for item in items:
        module, mod = _module(item) or "", getattr(item, "module", None)
        for name in FAST_MODULES.get(module, ()):
            if mod is not None and not name.startswith("[") and not hasattr(mod, name):
                missing.append(f"{module}::{name}")
    if missing:
        raise pytest.UsageError(f"tests/conftest.py FAST_MODULES names what is not there: "
                                f"{sorted(set(missing))}")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under exactly ``-m "not e2e"`` the end-to-end modules are not even imported (importing them, ray and
    verl and the trainers' helpers among them, costs the fast tier seconds); any other run collects them as usual."""
    if config.getoption("markexpr", "").strip() != "not e2e" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_") or not collection_path.is_relative_to(TESTS):
        return None
    return True if collection_path.relative_to(TESTS).as_posix() not in FAST_MODULES else None


# The longest modules first. Under pytest-xdist (`--dist loadfile`: a module stays on one worker; its reordering by
# test count is turned off in pytest_configure, or the many-test fast modules would go first) they are handed out
# first, so no worker starts one of them while the others are already done: the suite's wall time is the sum over
# workers, not the sum plus one long module at the end. The order is generated from the seconds each module took in
# a CI run (`.ci/run` writes JUnit XML; `python scripts/module_times.py .ci/junit.xml` rewrites
# tests/module_times.json). A stale or missing entry costs speed only: an unknown module runs after the timed ones.
MODULE_TIMES = TESTS / "module_times.json"
# Used only while tests/module_times.json is absent (a checkout from before the file was generated).
LONGEST_FIRST = ("chaos/test_chaos_ci.py", "test_thirdparty_trainers.py", "test_recipe_verl.py", "test_recipe_ray.py",
                 "test_multinode_jobs.py", "test_multinode_spares.py", "test_multinode_memory.py",
                 "test_flight_recorder_multinode.py", "chaos/test_partitions.py", "test_stragglers.py", "test_hung_fs.py",
                 "test_multinode.py", "test_ddp_exact_resume.py", "test_multinode_early_death.py",
                 "test_spare_first_connect.py", "test_memory_tier.py", "test_layouts_hf.py",
                 "test_multinode_persistent.py", "test_async_save.py", "test_deploy_slurm.py", "test_supervisor_run.py",
                 "test_multinode_etcd.py", "test_culprit.py", "test_flight_recorder.py", "test_layouts_deepspeed.py",
                 "test_warm_ranks.py", "test_layouts_trainers_cli.py", "test_thirdparty_pykeen.py",
                 "test_warm_launcher.py", "test_layouts_lightning.py")


def _longest_first_order() -> dict[str, int]:
    """Each module's place in the hand-out order: by the seconds module_times.json gives it, longest first."""
    try:
        times = json.loads(MODULE_TIMES.read_text())
        ranked = sorted((m for m, t in times.items() if isinstance(t, (int, float))), key=lambda m: -times[m])
    except (OSError, ValueError, AttributeError):
        ranked = list(LONGEST_FIRST)
    return {m: i for i, m in enumerate(ranked)}


def _longest_first(item: pytest.Item, order: dict[str, int]) -> int:
    return order.get(_module(item) or "", len(order))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _check_fast_modules(items)
    for item in items:
        if _is_e2e(item):
            item.add_marker(pytest.mark.e2e)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker sorts alike, so all collect the same list
        order = _longest_first_order()
        items.sort(key=lambda item: _longest_first(item, order))  # stable: the rest keep their order
