"""The loaded config is frozen; each component gets its own settings object built from it (in-process)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from supervisor.config import ConfigError, SupervisorConfig, load_config, to_yaml
from supervisor.diagnosis.hang_detector import AutoTimeout, HangDetector, HangSettings
from supervisor.cli.metrics import MetricsSettings


def test_loaded_config_cannot_change() -> None:
    cfg = load_config(None, environ={"RLSUP_FATAL_EXIT_CODES": "3,4", "RLSUP_PEERS": "a:1 b:2"}).config
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_restarts = 9  # type: ignore[misc]
    assert cfg.fatal_exit_codes == (3, 4) and cfg.peers == ("a:1", "b:2")  # tuples: no append either
    assert SupervisorConfig(fatal_exit_codes=[1]).fatal_exit_codes == (1,)  # a list given in code, too
    assert dataclasses.replace(cfg, max_restarts=9).max_restarts == 9 and cfg.max_restarts == 3
    assert cfg.resolved(Path("/base")).state_dir == "/base/.rlsup"


def test_overrides_are_a_validated_source_with_provenance() -> None:
    eff = load_config(None, environ={"RLSUP_BACKOFF_INITIAL": "7"}, overrides={"backoff_initial": 0.5},
                      overrides_origin="rlsup demo")
    assert eff.config.backoff_initial == 0.5 and eff.origins["backoff_initial"] == "rlsup demo"
    assert "backoff_initial: 0.5  # rlsup demo" in to_yaml(eff)
    with pytest.raises(ConfigError, match="rlsup demo: key 'backoff_jitter': must be in"):
        load_config(None, environ={}, overrides={"backoff_jitter": 2.0}, overrides_origin="rlsup demo")
    with pytest.raises(ConfigError, match="did you mean 'state_dir'"):
        load_config(None, environ={}, overrides={"state_dirs": "x"}, overrides_origin="rlsup demo")


def test_hang_settings(tmp_path: Path) -> None:
    cfg = SupervisorConfig(startup_timeout=11, save_timeout=22, heartbeat_timeout=None, heartbeat_timeout_initial=33,
                           auto_timeout_factor=2, auto_timeout_floor=4, auto_timeout_min_intervals=1)
    s = HangSettings.from_config(cfg)
    assert s == HangSettings(11, 22, None, 33, 2, 4, 1)
    assert HangSettings() == HangSettings.from_config(SupervisorConfig())  # defaults agree
    auto = AutoTimeout.from_settings(s)
    detector = HangDetector.from_settings(tmp_path, s, auto)
    assert (detector.startup_timeout, detector.save_timeout, detector.timeout()) == (11, 22, 33)
    auto.observe(3.0)  # learned: factor x longest interval, shared by every attempt's detector
    assert HangDetector.from_settings(tmp_path, s, auto).timeout() == 6.0
    assert HangDetector.from_settings(tmp_path, dataclasses.replace(s, heartbeat_timeout=5.0), auto).timeout() == 5.0


def test_metrics_settings() -> None:
    assert MetricsSettings.from_config(SupervisorConfig(metrics_port=0, metrics_addr="::1", job_name="j")) == \
        MetricsSettings(0, "::1", "j")
    assert MetricsSettings() == MetricsSettings.from_config(SupervisorConfig())


def test_coordinator_settings() -> None:
    from supervisor.cluster.job_store import CoordinatorSettings

    cfg = SupervisorConfig(coordinator_backend="etcd", coordinator_endpoints=["e1:2379", "e2:2379"],
                           coordinator_port=1234, rendezvous_timeout=9.0)
    assert CoordinatorSettings.from_config(cfg) == CoordinatorSettings("etcd", ("e1:2379", "e2:2379"), 1234, 9.0)
    assert CoordinatorSettings() == CoordinatorSettings.from_config(SupervisorConfig())
