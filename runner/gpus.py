"""GPUs as slots (PROTOCOL §14 "GPUs"): `mam-runner run --gpus auto|none|0,1,...` says which GPUs
the runner serves; a job dispatched with `--gpus N` gets exactly N of them, and no other job
sees those.

`auto` reads `nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader` (no GPU when
it is not on PATH or fails); a list names device indices. The runner announces `gpus` (how many)
and `gpus_free` in its presence, and the labels `gpu` and `gpu:<model>` (`gpu:nvidia-a100-sxm4-80gb`)
when it serves any. An attempt's GPUs reach its agent as `CUDA_VISIBLE_DEVICES` and
`NVIDIA_VISIBLE_DEVICES`; on a runner with GPUs a job that asked for none gets the empty list, so
it cannot take another job's.

    inventory, said = detect("auto", environ)     # said: one line, logged at start
    slots = GpuSlots(inventory.indices)
    slots.allocate("918b0612", 1)                  # ("0",), or None when fewer are free
    slots.release("918b0612")
"""

from __future__ import annotations

import csv
import io
import re
import shutil
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mam.shared.protocol import names
from mam.shared.protocol.errors import UsageError

NVIDIA_SMI = "nvidia-smi"
QUERY = ["--query-gpu=index,name,memory.total", "--format=csv,noheader"]
SMI_TIMEOUT_S = 10.0
"""How long `nvidia-smi` may take at start, seconds."""
MAX_GPUS = names.MAX_GPUS
GPUS_ENV = "MAM_RUNNER_GPUS"
CUDA_ENV = "CUDA_VISIBLE_DEVICES"
NVIDIA_ENV = "NVIDIA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class Inventory:
    """The GPUs a runner serves: device indices as strings (`"0"`, `"1"`) and a label-safe model
    name (`nvidia-a100-sxm4-80gb`, "" when unknown)."""

    indices: tuple[str, ...] = ()
    model: str = ""

    def labels(self) -> tuple[str, ...]:
        """The labels it adds to the runner's: `gpu` and `gpu:<model>`; none without GPUs."""
        if not self.indices:
            return ()
        return ("gpu", f"gpu:{self.model}") if self.model else ("gpu",)


def parse_spec(text: str, what: str = "--gpus") -> str | tuple[str, ...]:
    """`auto`, `none` or a list of device indices (`0,1`) as "auto", () or the indices.

    Raises:
        UsageError: one line naming the bad item.
    """
    value = text.strip().lower()
    if value == "auto":
        return "auto"
    if value in ("", "none"):
        return ()
    items = [item.strip() for item in value.split(",")]
    if len(items) > MAX_GPUS or any(not item.isdigit() or len(item) > 3 for item in items):
        raise UsageError(f"{what} {text[:40]!r} is invalid: expected auto, none or device indices such as 0,1")
    if len(set(items)) != len(items):
        raise UsageError(f"{what} names a GPU twice")
    return tuple(str(int(item)) for item in items)


def model_label(name: str) -> str:
    """`NVIDIA A100-SXM4-80GB` -> `nvidia-a100-sxm4-80gb`, cut so `gpu:<it>` is a §14 label."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug[: 32 - len("gpu:")].rstrip("-")


def parse_smi(text: str) -> Inventory:
    """The GPUs in `nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader` output
    (rows such as `0, NVIDIA A100-SXM4-80GB, 81920 MiB`); bad rows are skipped. The model is the
    first GPU's."""
    indices: list[str] = []
    model = ""
    for row in csv.reader(io.StringIO(text[:65536])):
        cells = [cell.strip() for cell in row]
        if len(cells) < 2 or not cells[0].isdigit() or len(cells[0]) > 3 or cells[0] in indices:
            continue
        indices.append(str(int(cells[0])))
        model = model or model_label(cells[1])
        if len(indices) == MAX_GPUS:
            break
    return Inventory(tuple(indices), model)


def detect(spec: str | tuple[str, ...], environ: Mapping[str, str]) -> tuple[Inventory, str]:
    """The GPUs to serve for a parsed `--gpus` value, and one line saying so (logged at start)."""
    if spec != "auto":
        inventory = Inventory(tuple(spec))
        return inventory, f"gpus: {', '.join(inventory.indices)} (as given)" if inventory.indices else "gpus: none"
    smi = shutil.which(NVIDIA_SMI, path=environ.get("PATH"))
    if smi is None:
        return Inventory(), f"gpus: none ({NVIDIA_SMI} is not on PATH)"
    try:
        done = subprocess.run([smi, *QUERY], capture_output=True, text=True, timeout=SMI_TIMEOUT_S,
                              env=dict(environ), check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Inventory(), f"gpus: none ({NVIDIA_SMI} failed: {type(exc).__name__})"
    if done.returncode != 0:
        return Inventory(), f"gpus: none ({NVIDIA_SMI} exited {done.returncode})"
    inventory = parse_smi(done.stdout)
    if not inventory.indices:
        return inventory, f"gpus: none ({NVIDIA_SMI} listed none)"
    return inventory, f"gpus: {', '.join(inventory.indices)} ({inventory.model or 'model unknown'}, from {NVIDIA_SMI})"


class GpuSlots:
    """Which of the runner's GPUs each running job holds; safe from any thread."""

    def __init__(self, indices: Sequence[str]) -> None:
        self.indices = tuple(indices)
        self._held: dict[str, tuple[str, ...]] = {}
        self._lock = threading.Lock()

    @property
    def total(self) -> int:
        return len(self.indices)

    @property
    def free(self) -> int:
        with self._lock:
            return self.total - sum(len(held) for held in self._held.values())

    def allocate(self, job_id: str, count: int) -> tuple[str, ...] | None:
        """`count` free GPUs for `job_id` (lowest indices first), or None when fewer are free."""
        with self._lock:
            taken = {index for held in self._held.values() for index in held}
            free = [index for index in self.indices if index not in taken]
            if count > len(free):
                return None
            self._held[job_id] = tuple(free[:count])
            return self._held[job_id]

    def release(self, job_id: str) -> None:
        """`job_id` ended: its GPUs are free again."""
        with self._lock:
            self._held.pop(job_id, None)


def agent_env(gpus: tuple[str, ...] | None) -> dict[str, str]:
    """What the agent's environment says of its GPUs: `gpus` (its own, maybe none) on a
    runner that has GPUs; nothing (None) on one that has none."""
    if gpus is None:
        return {}
    shown = ",".join(gpus)
    return {CUDA_ENV: shown, NVIDIA_ENV: shown or "none"}


__all__ = ["GPUS_ENV", "GpuSlots", "Inventory", "agent_env", "detect", "model_label", "parse_smi", "parse_spec"]
