"""PROTOCOL §14 Targets: label syntax (`names`), presence `labels` on the wire
(optional, signed, hostile values refused), the runner's `--labels` /
MAM_RUNNER_LABELS (else the enrolled ones, with the enrolled session) and the hub's
`presence_view`."""

from __future__ import annotations

import json
import os

import pytest

from mam.orchestrator.runners import presence_view, verify_presence
from mam.runner import enrol
from mam.runner.settings import options_from_cli
from mam.shared.protocol import crypto, names, wire
from mam.shared.protocol.errors import ConfigError, DecodeError, SignatureError, UsageError

KEYS = crypto.derive_keys("s" * 40)
ROOT = "python/mqtt"
TOPIC = f"{ROOT}/runners/gpu-box"


def presence(labels: tuple[str, ...] = ("gpu",), keys: crypto.DispatchKeys = KEYS) -> dict[str, object]:
    built = wire.Presence.build("gpu-box", "a" * 32, "online", host="h", version="1", max_jobs=2,
                                labels=labels)
    return crypto.sign(built.to_dict(), keys.sign_key)


def test_s14_parse_labels_sorts_and_refuses_with_one_line() -> None:
    assert names.parse_labels("gpu,cuda12") == ("cuda12", "gpu")
    assert names.parse_labels("a.b:c-d_e") == ("a.b:c-d_e",)
    for bad in ("", "GPU", "gpu,,x", "-x", "x" * 33, "a b", "gpu,gpu", "é", ",".join(f"l{n}" for n in range(17))):
        with pytest.raises(UsageError) as info:
            names.parse_labels(bad)
        assert "\n" not in str(info.value)


def test_s14_presence_labels_are_signed_and_optional() -> None:
    signed = presence(("x", "gpu"))
    assert signed["labels"] == ["gpu", "x"]  # sorted (§14)
    row = verify_presence(TOPIC, wire.encode(signed), KEYS, ROOT)
    assert row["labels"] == ["gpu", "x"]
    unlabelled = presence(())
    assert "labels" not in unlabelled  # a v1 hub refuses unknown presence fields
    assert verify_presence(TOPIC, wire.encode(unlabelled), KEYS, ROOT)["labels"] == []
    tampered = dict(signed, labels=["gpu", "tpu"])
    view = presence_view(TOPIC, json.dumps(tampered).encode(), KEYS, ROOT, 5.0)
    assert view.verified is False and view.labels == frozenset({"gpu", "tpu"})
    view = presence_view(TOPIC, wire.encode(signed), KEYS, ROOT, 5.0)
    assert view.verified and view.labels == frozenset({"gpu", "x"}) and abs(view.seen_at - 5.0) < 5.0


def test_s14_a_signed_presence_with_an_unknown_field_verifies() -> None:
    signed = crypto.sign(dict(presence(("gpu",)), last_refusal={"job_id": "918b0612"}), KEYS.sign_key)
    view = presence_view(TOPIC, json.dumps(signed).encode(), KEYS, ROOT, 0.0)
    assert view.verified and view.labels == frozenset({"gpu"})
    assert verify_presence(TOPIC, json.dumps(signed).encode(), KEYS, ROOT)["labels"] == ["gpu"]


@pytest.mark.parametrize("labels", [["GPU"], "gpu", [1], ["x"] * 2, [f"l{n}" for n in range(17)], ["a\nb"],
                                    [None], [["gpu"]], ["x" * 1000]])
def test_s14_hostile_presence_labels_are_refused_by_decode(labels: object) -> None:
    signed = dict(presence(()), labels=labels)
    with pytest.raises(DecodeError) as info:
        presence_view(TOPIC, json.dumps(signed).encode(), KEYS, ROOT, 0.0)
    assert "labels" in str(info.value) or "label" in str(info.value)


def test_s14_runner_labels_from_flag_or_environment(tmp_path) -> None:
    environ = {"PATH": os.defpath, "MAM_ENV_FILE": str(tmp_path / "none.env")}
    args = {"session": "gpu-box", "exec_cmd": "true", "workspace": str(tmp_path / "ws"), "workdir": None,
            "max_jobs": 1, "once": False, "replace": False}
    assert options_from_cli(environ=environ, **args).labels == ()  # type: ignore[arg-type]
    assert options_from_cli(environ=environ, labels="gpu,cuda12", **args).labels == ("cuda12", "gpu")  # type: ignore[arg-type]
    from_env = {**environ, "MAM_RUNNER_LABELS": "x"}
    assert options_from_cli(environ=from_env, **args).labels == ("x",)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="--labels 'Bad' is invalid|label 'Bad' is invalid"):
        options_from_cli(environ=environ, labels="Bad", **args)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="MAM_RUNNER_LABELS"):
        options_from_cli(environ={**environ, "MAM_RUNNER_LABELS": "a,,b"}, **args)  # type: ignore[arg-type]


def test_s16_run_defaults_to_the_enrolled_session_and_labels(tmp_path) -> None:
    environ = {"PATH": os.defpath, "MAM_ENV_FILE": str(tmp_path / "none.env")}
    ws = tmp_path / "ws"
    ws.mkdir()
    args = {"exec_cmd": "true", "workspace": str(ws), "workdir": None, "max_jobs": 1, "once": False,
            "replace": False, "environ": environ}
    with pytest.raises(UsageError, match=r"^--session is missing: give --session NAME, or enrol this host first"):
        options_from_cli(session=None, **args)  # type: ignore[arg-type]
    enrol.enroll(session="gpu-box", labels="linux,gpu", workspace=ws)
    options = options_from_cli(session=None, **args)  # type: ignore[arg-type]
    assert (options.session, options.labels) == ("gpu-box", ("gpu", "linux"))
    assert options_from_cli(session="gpu-box", labels="arm", **args).labels == ("arm",)  # type: ignore[arg-type]
    from_env = {**args, "environ": {**environ, "MAM_RUNNER_LABELS": "x"}}
    assert options_from_cli(session=None, **from_env).labels == ("x",)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="--session cpu-box is not this host's enrolled session gpu-box"):
        options_from_cli(session="cpu-box", **args)  # type: ignore[arg-type]
    names.runner_identity_path(ws).write_text('{"session": "../../etc", "labels": []}')  # hostile: refused
    with pytest.raises(ConfigError, match="runner.json: "):
        options_from_cli(session=None, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(("status", "will", "shown"), [
    ("offline", True, ("lost", "last_will")),
    ("offline", "true", ("offline", None)),  # only JSON true says it (a hostile or mistaken value: not lost)
    ("offline", 1, ("offline", None)),
    ("online", True, ("online", None)),  # a Will is an offline presence
])
def test_s7_only_a_signed_offline_with_will_true_is_a_lost_runner(status: str, will: object,
                                                                  shown: tuple[str, object]) -> None:
    built = wire.Presence.build("gpu-box", "a" * 32, status, host="h", version="1", max_jobs=2)
    signed = crypto.sign({**built.to_dict(), "will": will}, KEYS.sign_key)
    row = verify_presence(TOPIC, json.dumps(signed).encode(), KEYS, ROOT)
    assert (row["status"], row["lost"]) == shown
    assert presence_view(TOPIC, json.dumps(signed).encode(), KEYS, ROOT, 0.0).will is (shown[1] == "last_will")
    forged = dict(signed, will=True, status="offline") if status == "offline" else None
    if forged is not None and will is not True:  # the field is signed: adding it breaks the signature
        with pytest.raises(SignatureError):
            verify_presence(TOPIC, json.dumps(forged).encode(), KEYS, ROOT)
