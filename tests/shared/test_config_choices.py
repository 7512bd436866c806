"""Every choice-valued config key takes its choices from where the code dispatches on them.

For each such key the accepted values are read here from the dispatch source itself (the layout catalogue,
the progress presets, the straggler actions, the coordination backends, the log formats, the signal module),
never from the config: the config accepts each of them from a file, the environment and a flag, refuses an
unknown one with an error naming the key, the value and the file and line, and its help, flag and generated
reference list the same names. The config imports no component: the layouts' and presets' names are written
again in supervisor/settings_vocabulary.py, and kept equal to the catalogues here, in order.
"""

from __future__ import annotations

import argparse
import signal
import typing
from pathlib import Path
from typing import Callable

import pytest

from supervisor import config, layouts, log

from supervisor.diagnosis import step_reports as progress
from supervisor.config import ConfigError, load_config
from supervisor.layouts import single_file
from supervisor import settings_vocabulary
from supervisor.settings_vocabulary import CoordinatorBackend, StragglerAction

#: key -> the names the code dispatches on, read from the code that dispatches.
DISPATCH: dict[str, Callable[[], tuple[str, ...]]] = {
    "checkpoint_layout": lambda: ("auto", *layouts.LAYOUTS, single_file.NAME),  # layouts._resolve
    "progress": lambda: ("", *progress.PRESETS),  # progress.progress_pattern; empty: off
    "straggler_action": lambda: typing.get_args(StragglerAction),  # run.settings: StragglerWatch(restart=...)
    "coordinator_backend": lambda: typing.get_args(CoordinatorBackend),  # job_store.connect_coordinator
    "log_format": lambda: log.FORMATS,  # log.LineFormatter
}
NOUN = {"checkpoint_layout": "layout", "progress": "preset", "straggler_action": "action",
        "coordinator_backend": "backend", "log_format": "format"}


def test_every_choice_key_names_its_dispatch_source() -> None:
    """A new choice-valued key must say here where its names come from."""
    assert set(config.choice_keys()) == set(DISPATCH)


@pytest.mark.parametrize("key", sorted(DISPATCH))
def test_choices_are_the_dispatched_names(key: str) -> None:
    assert set(config.choices(key)) == set(DISPATCH[key]())
    assert len(config.choices(key)) == len(set(config.choices(key)))


def test_the_vocabularys_names_are_the_catalogues_in_order() -> None:
    """The config's copies of the layout catalogue's and the progress presets' names (it imports neither)."""
    assert settings_vocabulary.CATALOGUE_LAYOUTS == tuple(layouts.LAYOUTS)
    assert settings_vocabulary.SINGLE_FILE_LAYOUT == single_file.NAME
    assert settings_vocabulary.PROGRESS_PRESETS == tuple(progress.PRESETS)
    assert config.choices("checkpoint_layout") == DISPATCH["checkpoint_layout"]()
    assert config.choices("progress") == DISPATCH["progress"]()


@pytest.mark.parametrize("key", sorted(DISPATCH))
def test_every_dispatched_name_is_accepted_from_each_source(key: str, tmp_path: Path) -> None:
    flag = "--" + key.replace("_", "-")
    extra = {"coordinator_endpoints": ("e1:2379",)}  # etcd needs its members; harmless for the rest
    for name in DISPATCH[key]():
        path = tmp_path / "rlsup.yaml"
        path.write_text(f"{key}: '{name}'\n")
        args = argparse.Namespace(config=path)
        assert getattr(load_config(args, environ={}, overrides=extra).config, key) == name
        env = {"RLSUP_" + key.upper(): name}
        assert getattr(load_config(environ=env, overrides=extra).config, key) == name
        assert getattr(load_config(_flags(flag, name), environ={}, overrides=extra).config, key) == name


@pytest.mark.parametrize("key", sorted(DISPATCH))
def test_an_unknown_name_is_refused_naming_key_value_file_and_line(key: str, tmp_path: Path) -> None:
    path = tmp_path / "rlsup.yaml"
    path.write_text(f"max_restarts: 1\n{key}: nosuch-choice\n")
    with pytest.raises(ConfigError) as info:
        load_config(argparse.Namespace(config=path), environ={})
    said = str(info.value)
    assert said.startswith(f"{path}:2: key '{key}': unknown {NOUN[key]} 'nosuch-choice' (one of ")
    assert all(name in said for name in DISPATCH[key]() if name)
    flag = "--" + key.replace("_", "-")
    with pytest.raises(ConfigError, match=f"^flag {flag}: key '{key}': unknown {NOUN[key]} 'Nope'"):
        load_config(_flags(flag, "Nope"), environ={})
    with pytest.raises(ConfigError, match=f"^env RLSUP_{key.upper()}: key '{key}': unknown"):
        load_config(environ={"RLSUP_" + key.upper(): "nope"})
    with pytest.raises(ConfigError, match=f"^{path}:1: key '{key}': unknown {NOUN[key]} '3'"):
        path.write_text(f"{key}: 3\n")
        load_config(argparse.Namespace(config=path), environ={})


@pytest.mark.parametrize("key", sorted(DISPATCH))
def test_help_flag_and_reference_list_the_same_names(key: str) -> None:
    names = [n for n in DISPATCH[key]() if n]
    field = {f.name: f for f in config.dataclasses.fields(config.SupervisorConfig)}[key]
    assert all(name in field.metadata["help"] for name in names), "the help text misses a choice"
    parser = argparse.ArgumentParser()
    config.add_flags(parser)
    assert f"--{key.replace('_', '-')} {{{','.join(names)}}}" in parser.format_usage()
    row = next(line for line in config.reference_markdown().splitlines() if line.startswith(f"| `{key}` |"))
    assert row.split(" | ")[2] == "one of " + ", ".join(f"`{n}`" for n in names) + (
        " or empty" if "" in DISPATCH[key]() else "")


def test_the_dispatchers_take_every_name_the_config_accepts(tmp_path: Path) -> None:
    """The other direction: each name the config lets through is one the code knows."""
    for name in config.choices("checkpoint_layout"):
        layouts.scan(tmp_path, name)  # an unknown name raises ValueError
    for name in config.choices("progress"):
        assert (progress.progress_pattern(name, "") is None) == (name == "")
    for name in config.choices("log_format"):
        log.LineFormatter(name)


def test_preempt_signal_accepts_every_signal_the_signal_module_names() -> None:
    for sig in signal.Signals:
        for name in (sig.name, sig.name.removeprefix("SIG")):
            assert load_config(environ={"RLSUP_PREEMPT_SIGNAL": name}).config.preempt_signal == name
    with pytest.raises(ConfigError, match="^env RLSUP_PREEMPT_SIGNAL: key 'preempt_signal': unknown signal 'NOPE'"):
        load_config(environ={"RLSUP_PREEMPT_SIGNAL": "NOPE"})


def test_log_level_flag_takes_the_levels_the_logging_setup_knows() -> None:
    from supervisor.cli.main import build_parser

    assert f"--log-level {{{','.join(log.LEVELS)}}}" in build_parser().format_usage()


def test_the_sampler_count_refuses_an_unknown_name() -> None:
    """A rank-side API choice (not a config key), checked against its Literal type too."""
    from trainer_hooks.sampler import ResumableSampler, SamplerCount

    for name in typing.get_args(SamplerCount):
        assert ResumableSampler(8, 1, 0, count=name).count == name
    with pytest.raises(ValueError, match="count must be one of 'yield', 'manual'.*got 'auto'"):
        ResumableSampler(8, 1, 0, count="auto")  # type: ignore[arg-type]


def _flags(flag: str, value: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    config.add_flags(parser)
    return parser.parse_args([flag, value])
