"""runner/gpus.py and the GPU fields of the wire (PROTOCOL §14 "GPUs"): `--gpus` parsed or
refused in one line, `nvidia-smi` read (a stub on PATH), hostile output skipped, slots handed
out without overlap, the agent's environment, and `gpus`/`gpus_free` in a presence."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from mam.runner import gpus
from mam.shared.protocol import crypto, wire
from mam.shared.protocol.errors import DecodeError, UsageError

pytestmark = pytest.mark.timeout(60)

TABLE = "0, NVIDIA A100-SXM4-80GB, 81920 MiB\n1, NVIDIA A100-SXM4-80GB, 81920 MiB\n"


@pytest.mark.parametrize(("text", "parsed"), [
    ("auto", "auto"), (" AUTO ", "auto"), ("none", ()), ("", ()), ("0,1", ("0", "1")), ("3, 01", ("3", "1")),
])
def test_gpus_spec_is_auto_none_or_device_indices(text, parsed):
    assert gpus.parse_spec(text) == parsed


@pytest.mark.parametrize(("text", "words"), [
    ("0,0", "--gpus names a GPU twice"), ("a,b", "--gpus 'a,b' is invalid"), ("-1", "is invalid"),
    ("0," * 100, "is invalid"), ("1000", "is invalid"), ("0;rm -rf /", "is invalid"),
])
def test_a_bad_gpus_spec_is_refused_in_one_line(text, words):
    with pytest.raises(UsageError, match=words) as caught:
        gpus.parse_spec(text)
    assert "\n" not in str(caught.value)


def test_nvidia_smi_output_gives_indices_and_a_model_label_and_bad_rows_are_skipped():
    inventory = gpus.parse_smi(TABLE)
    assert inventory == gpus.Inventory(("0", "1"), "nvidia-a100-sxm4-80gb")
    assert inventory.labels() == ("gpu", "gpu:nvidia-a100-sxm4-80gb")
    hostile = "x, evil\n0, \x1b[2JEvil GPU " + "Z" * 500 + ", 1 MiB\n0, dup, 1\n\n9999, big, 1\n"
    found = gpus.parse_smi(hostile)
    assert found.indices == ("0",) and len(f"gpu:{found.model}") <= 32 and found.model.startswith("2jevil-gpu-z")
    assert gpus.Inventory().labels() == ()


def stub_smi(tmp_path: Path, body: str) -> dict[str, str]:
    """A PATH whose `nvidia-smi` prints `body` (the issue's stub)."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    smi = folder / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n{body}\n")
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{folder}:{os.environ.get('PATH', '')}"}


def test_auto_asks_nvidia_smi_and_says_what_it_found_in_one_line(tmp_path):
    inventory, said = gpus.detect("auto", stub_smi(tmp_path, f"printf '{TABLE}'"))
    assert inventory.indices == ("0", "1")
    assert said == "gpus: 0, 1 (nvidia-a100-sxm4-80gb, from nvidia-smi)"
    assert gpus.detect("auto", stub_smi(tmp_path, "exit 9")) == (gpus.Inventory(), "gpus: none (nvidia-smi exited 9)")
    assert gpus.detect("auto", {"PATH": str(tmp_path / "empty")})[1] == "gpus: none (nvidia-smi is not on PATH)"
    assert gpus.detect(("2", "3"), {}) == (gpus.Inventory(("2", "3")), "gpus: 2, 3 (as given)")
    assert gpus.detect((), {}) == (gpus.Inventory(), "gpus: none")


def test_slots_never_hand_a_gpu_to_two_jobs():
    slots = gpus.GpuSlots(("0", "1", "2"))
    assert slots.allocate("a", 2) == ("0", "1") and slots.free == 1
    assert slots.allocate("b", 2) is None and slots.free == 1
    assert slots.allocate("c", 0) == () and slots.allocate("b", 1) == ("2",) and slots.free == 0
    slots.release("a")
    slots.release("never")
    assert slots.free == 2 and slots.allocate("d", 2) == ("0", "1")


def test_the_agent_sees_only_its_own_gpus():
    assert gpus.agent_env(("1", "3")) == {"CUDA_VISIBLE_DEVICES": "1,3", "NVIDIA_VISIBLE_DEVICES": "1,3"}
    assert gpus.agent_env(()) == {"CUDA_VISIBLE_DEVICES": "", "NVIDIA_VISIBLE_DEVICES": "none"}
    assert gpus.agent_env(None) == {}


def presence(**extra: object) -> bytes:
    built = wire.Presence.build("gpu-box", "a" * 32, "online", host="h", version="1", max_jobs=2)
    obj = {**built.to_dict(), **extra}
    return wire.encode(crypto.sign(obj, crypto.derive_keys("s" * 32).sign_key))


def test_a_presence_carries_gpus_and_gpus_free_signed_and_refuses_bad_ones():
    built = wire.Presence.build("gpu-box", "a" * 32, "online", host="h", version="1", max_jobs=2, gpus=(2, 1))
    assert (built.to_dict()["gpus"], built.to_dict()["gpus_free"]) == (2, 1)
    decoded = wire.decode(presence(gpus=2, gpus_free=1), "presence")
    assert (decoded.gpus, decoded.gpus_free) == (2, 1)
    assert wire.decode(presence(), "presence").gpus is None
    for bad, words in [({"gpus": 2}, "go together"), ({"gpus": 2, "gpus_free": 3}, "gpus_free"),
                       ({"gpus": 0, "gpus_free": 0}, "gpus"), ({"gpus": 65, "gpus_free": 0}, "gpus"),
                       ({"gpus": "2", "gpus_free": 1}, "gpus"), ({"gpus": True, "gpus_free": 1}, "gpus")]:
        with pytest.raises(DecodeError, match=words) as caught:
            wire.decode(presence(**bad), "presence")
        assert "\n" not in caught.value.reason


def test_a_job_asks_for_gpus_in_its_signed_work():
    assert wire.Work.from_dict({"gpus": 2}).gpus == 2
    for bad in (0, 65, True, "1", 1.5):
        with pytest.raises(DecodeError, match="gpus"):
            wire.Work.from_dict(json.loads(json.dumps({"gpus": bad})))
