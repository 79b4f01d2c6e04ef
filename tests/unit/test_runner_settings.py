"""runner/settings.py: `mam-runner run` arguments and every runner MAM_* setting,
read once (PROTOCOL §5, §6, §7, §11, §13)."""

from __future__ import annotations

import os

import pytest

from mam.runner import settings
from mam.runner.settings import RunnerOptions, options_from_cli
from mam.shared import config
from mam.shared.protocol.errors import ConfigError, UsageError


def env(tmp_path, **values: str) -> dict[str, str]:
    """A minimal environment: PATH for the agent command, a `.mam.env` of its own."""
    return {"PATH": os.defpath, "MAM_ENV_FILE": str(tmp_path / "none.env"), **values}


def options(tmp_path, environ: dict[str, str], **changes: object) -> RunnerOptions:
    args: dict[str, object] = {"session": "gpu-box", "exec_cmd": "true", "workspace": str(tmp_path / "ws"),
                               "workdir": None, "max_jobs": 1, "once": False, "replace": False}
    args.update(changes)
    return options_from_cli(environ=environ, **args)  # type: ignore[arg-type]


def test_defaults(tmp_path):
    opts = options(tmp_path, env(tmp_path))
    assert opts.argv == ("true",) and opts.root == (tmp_path / "ws").resolve()
    assert (opts.cancel_grace_s, opts.clock_skew_s, opts.presence_wait_s, opts.presence_refresh_s,
            opts.agent_linger_s) == (10.0, 30.0, 1.0, 60.0, 30.0)
    assert opts.heartbeat_drain_s == 1.0


def test_every_setting_is_read_from_one_resolution_of_the_environment(tmp_path, monkeypatch):
    calls = []
    real = config.load_env

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(config, "load_env", counting)
    opts = options(tmp_path, env(tmp_path, MAM_CANCEL_GRACE_S="2.5", MAM_CLOCK_SKEW_S="5",
                                 MAM_PRESENCE_WAIT_S="0.2", MAM_PRESENCE_REFRESH_S="1",
                                 MAM_AGENT_LINGER_S="7", MAM_HEARTBEAT_DRAIN_S="0.5", MAM_LEASE_MARGIN_S="3"))
    assert len(calls) == 1
    assert (opts.cancel_grace_s, opts.clock_skew_s, opts.presence_wait_s, opts.presence_refresh_s,
            opts.agent_linger_s, opts.heartbeat_drain_s, opts.lease_margin_s) == (2.5, 5.0, 0.2, 1.0, 7.0, 0.5, 3.0)
    assert options(tmp_path, env(tmp_path)).lease_margin_s is None  # unset: a share of each lease (§10)


def test_settings_come_from_the_env_file_under_the_environment(tmp_path):
    env_file = tmp_path / "runner.env"
    env_file.write_text("MAM_CANCEL_GRACE_S=3\nMAM_CLOCK_SKEW_S=4\n")
    opts = options(tmp_path, env(tmp_path, MAM_ENV_FILE=str(env_file), MAM_CLOCK_SKEW_S="9"))
    assert (opts.cancel_grace_s, opts.clock_skew_s) == (3.0, 9.0)


def test_repositories_come_from_the_env_file_unless_flags_name_them(tmp_path):
    env_file = tmp_path / "runner.env"
    env_file.write_text('MAM_RUNNER_REPOS="demo=git://hub:9418/demo, tools=/srv/git/tools.git"\n')
    environ = env(tmp_path, MAM_ENV_FILE=str(env_file))
    served = options(tmp_path, environ).repos
    assert [(spec.name, spec.url) for spec in served] == [("demo", "git://hub:9418/demo"),
                                                          ("tools", "/srv/git/tools.git")]
    flagged = options(tmp_path, environ, repos=["other=/srv/git/other.git"]).repos
    assert [spec.name for spec in flagged] == ["other"]
    env_file.write_text("MAM_RUNNER_REPOS=demo\n")
    with pytest.raises(UsageError, match="^MAM_RUNNER_REPOS 'demo': expected NAME=URL"):
        options(tmp_path, environ)


@pytest.mark.parametrize(("name", "value", "message"), [
    ("MAM_CANCEL_GRACE_S", "soon", "MAM_CANCEL_GRACE_S='soon' is invalid: expected a number of seconds"),
    ("MAM_CANCEL_GRACE_S", "3601", "MAM_CANCEL_GRACE_S=3601.0 is out of range 0.0..3600.0"),
    ("MAM_PRESENCE_REFRESH_S", "0.5", "MAM_PRESENCE_REFRESH_S=0.5 is out of range 1.0..60.0"),
    ("MAM_PRESENCE_WAIT_S", "61", "MAM_PRESENCE_WAIT_S=61.0 is out of range 0.0..60.0"),
    ("MAM_LEASE_MARGIN_S", "0", "MAM_LEASE_MARGIN_S=0.0 is out of range 0.1..3600.0"),
    ("MAM_LEASE_MARGIN_S", "nan", "MAM_LEASE_MARGIN_S=nan is out of range 0.1..3600.0"),
])
def test_a_bad_setting_is_a_config_error_naming_it(tmp_path, name, value, message):
    with pytest.raises(ConfigError) as caught:
        options(tmp_path, env(tmp_path, **{name: value}))
    assert str(caught.value) == message


def test_read_seconds_matches_env_float():
    for value in ("", "0", "2.5", "86400"):
        got = settings.read_seconds({"MAM_CLOCK_SKEW_S": value}, settings.CLOCK_SKEW)
        assert got == config.env_float("MAM_CLOCK_SKEW_S", 30.0, environ={"MAM_CLOCK_SKEW_S": value,
                                                                          "MAM_ENV_FILE": "/nonexistent"},
                                       high=86400.0)


@pytest.mark.parametrize(("changes", "message"), [
    ({"max_jobs": 0}, "--max-jobs 0 is invalid: expected 1..64"),
    ({"max_jobs": 65}, "--max-jobs 65 is invalid"),
    ({"max_jobs": True}, "--max-jobs True is invalid"),
    ({"session": "gpu.box"}, "session name"),
    ({"exec_cmd": ""}, "--exec"),
    ({"workdir": "  "}, "--workdir is empty"),
])
def test_bad_arguments_are_usage_errors(tmp_path, changes, message):
    with pytest.raises(UsageError, match=message.replace(".", r"\.")):
        options(tmp_path, env(tmp_path), **changes)


def test_workdir_is_created_and_absolute(tmp_path):
    opts = options(tmp_path, env(tmp_path), workdir=str(tmp_path / "work" / "here"))
    assert opts.workdir == tmp_path / "work" / "here" and opts.workdir.is_dir()


def test_s11_enrol_writes_runs_defaults_and_run_reads_them_from_its_workspace(tmp_path, monkeypatch):
    """`enroll --repo ... --max-jobs N` writes MAM_RUNNER_REPOS and MAM_RUNNER_MAX_JOBS; `run`
    reads them from the workspace's `.mam.env` (started from any directory); a flag wins."""
    from mam.runner.enrol import write_env

    defaults = settings.run_defaults(["app=git://100.64.0.9/app.git", "docs=/srv/docs.git"], 3)
    assert defaults == {"MAM_RUNNER_REPOS": "app=git://100.64.0.9/app.git docs=/srv/docs.git",
                        "MAM_RUNNER_MAX_JOBS": "3"}
    assert settings.run_defaults(None, None) == {}
    workspace = tmp_path / "ws"
    workspace.mkdir()
    written = write_env(workspace, defaults)
    assert written == workspace / ".mam.env" and written.stat().st_mode & 0o777 == 0o600
    monkeypatch.chdir(tmp_path)  # not the workspace: its .mam.env is found through --workspace
    environ = {"PATH": os.defpath}
    opts = options(tmp_path, environ, max_jobs=None)
    assert opts.max_jobs == 3 and [spec.name for spec in opts.repos] == ["app", "docs"]
    assert options(tmp_path, environ, max_jobs=5).max_jobs == 5


@pytest.mark.parametrize(("repos", "max_jobs", "said"), [
    (["no-url"], None, "--repo"), (["a=x", "a=y"], None, "twice"), (None, 0, "--max-jobs 0 is invalid"),
    (None, 65, "--max-jobs 65 is invalid"), (None, True, "--max-jobs True is invalid"),
])
def test_s11_bad_enrolment_defaults_are_refused_in_one_line(repos, max_jobs, said):
    with pytest.raises(UsageError, match=said) as refused:
        settings.run_defaults(repos, max_jobs)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("value", ["0", "abc", "65", "9" * 400])
def test_s11_a_bad_mam_runner_max_jobs_is_one_line(tmp_path, value):
    with pytest.raises(UsageError, match="MAM_RUNNER_MAX_JOBS") as refused:
        options(tmp_path, env(tmp_path, MAM_RUNNER_MAX_JOBS=value), max_jobs=None)
    assert len(str(refused.value)) < 200
