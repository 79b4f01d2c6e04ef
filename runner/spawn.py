"""How an agent joins its job's cgroups before its program runs (§6), without a fork
of the runner.

A process joins a cgroup by writing "0" to the group's `cgroup.procs`. Done between
fork and exec (`Popen(preexec_fn=...)`), that costs a real `fork()` of the runner:
CPython may `vfork()` only when there is no `preexec_fn`, and copying a threaded
50 MB process, running its after-fork handlers and paying the copy-on-write faults
cost about 5 ms and 5-6 ms of CPU more a spawn here than a `vfork`, with the GIL
held in the parent (docs/benchmarks.md). The first move into a group also waits for an RCU grace
period (5-13 ms on a cgroup2 mount without `favordynmods`), and the parent's
`Popen` waited for all of it.

So where it can, the runner spawns a small bash stub instead (`vfork`, no
`preexec_fn`): the stub writes "0" to each group's `cgroup.procs` it inherited, closes
them and `exec`s the agent's program under the agent's own `argv[0]`. The agent's
program still never runs outside its groups; the grace period is waited for in the
child while the runner goes on. Bash changes a few variables of the environment
it passes on (`PWD`, `OLDPWD`, `IFS`, `_`), and warns of an `LC_ALL` the host has
no locale for; the stub puts back what the agent was given, without the warning.
`SHLVL`: bash counts itself in and `exec` counts itself out, so a number comes
through as it was, and an absent `SHLVL` reaches the agent as `SHLVL=0` (which
every shell treats as absent: it starts at 1).

The stub can also hold the agent: after the join it waits for a line on a gate
pipe, and only then execs. The runner spawns it so before `started` and releases
it once `started` is out (§11.3), so the join's wait overlaps `started`'s record
and PUBACKs. A stub whose gate closes unwritten (its runner died) exits with 125
without running the program.

The stub is not used, and the agent starts the old way (`joiner` as `preexec_fn`,
exactly as `Popen` would run it), when:
- there is no bash at /bin/bash or /usr/bin/bash;
- the program is not plainly an ELF binary or a `#!` script whose interpreter
  exists: `Popen` then reports an exec error (a script without `#!`, a missing
  interpreter) as the agent failing to start, which a stub could only report
  as an exit status;
- the environment names a variable bash reads or sets itself (`BASH_ENV`,
  `SHELLOPTS`, exported functions, `PPID`, `RANDOM`, ...; `SPECIAL_NAMES`), or
  an `SHLVL` that is not a small number: bash would run, change or drop it; or
  a variable to put back that is longer than `MAX_RESTORED_CHARS`.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Mapping, Sequence

BASH_PATHS = ("/bin/bash", "/usr/bin/bash")
"""Where the stub's bash is looked for (never on the agent's PATH, which the job's
environment sets)."""

HEADER_BYTES = 256
"""How much of the program is read to tell an ELF binary or a `#!` line."""

MAX_RESTORED_CHARS = 4096
"""Longest value of a restored variable the stub's script carries (the script is one
argument, and Linux caps one at 128 KiB); a longer one starts the agent the old way."""

MAX_SHLVL = 997
"""Largest `SHLVL` passed through the stub (bash resets 1,000 and above, with a warning)."""

# Variables bash reads at start (BASH_ENV is sourced, SHELLOPTS applied) or does not
# pass on as given (it sets them, or drops them from the export), found by trying
# each of the manual's shell variables; names starting with BASH or COMP_ count too.
SPECIAL_NAMES: frozenset[str] = frozenset({
    "ENV", "SHELLOPTS", "POSIXLY_CORRECT", "PS1", "PS2", "PPID", "RANDOM", "SRANDOM", "LINENO",
    "OPTIND", "OPTERR", "HISTCMD", "EPOCHSECONDS", "EPOCHREALTIME", "PS4",
})
SPECIAL_PREFIXES = ("BASH", "COMP_")

# Put back after bash's start: exported as given, or unset when not given.
RESTORED_NAMES = ("PWD", "OLDPWD", "IFS")
# Left out of bash's start and exported by the stub with its warnings silenced
# (bash warns on stderr, the job's log, of an LC_ALL naming a locale the host lacks).
QUIET_NAMES = ("LC_ALL",)

# $0: the agent's argv[0]; $1: its program; $2: the inherited cgroup.procs fds;
# $3: a gate's fd or nothing; then its arguments. A group it cannot join is said on
# stderr (the job's log), and the agent runs in the rest, as with `joiner`. With a
# gate, the stub then waits for a line on it and ends (status 125) at its end
# instead. No variable of the shell's own is left (the function's are local): the
# agent's environment may name any of them.
_JOIN = ('j() { local f; for f in $1; do printf 0 2>/dev/null >&"$f" || printf "%s\\n" "mam-runner: the agent '
         'is not in one of its cgroups (fd $f); cancel stops its process group" >&2; exec {f}>&-; done; '
         'if [ -n "$2" ]; then local g; f=$2; read -r -u "$f" g || exit 125; exec {f}<&-; fi; }; '
         'j "$2" "$3"; unset -f j; ')


def joiner(fds: Sequence[int]) -> Callable[[], None]:
    """The child's step between fork and exec, the old way: join each cgroup whose
    `cgroup.procs` is in `fds` (one write of "0" each, no lock taken, nothing allocated
    that another thread could hold)."""
    def join() -> None:
        for fd in fds:
            try:
                os.write(fd, b"0")
            except OSError:
                pass  # the parent sees it is not a member and says so
    return join


def find_bash() -> str | None:
    """The stub's bash, or None."""
    for path in BASH_PATHS:
        if os.access(path, os.X_OK) and os.path.isfile(path):
            return path
    return None


_BASH = find_bash()


def usable(executable: str, env: Mapping[str, str]) -> bool:
    """True where the stub can start `executable` with exactly `env` (see the module's
    docstring for where it cannot)."""
    return _BASH is not None and _plain_program(executable) and _plain_env(env)


def stub_argv(executable: str, argv: Sequence[str], env: Mapping[str, str], fds: Sequence[int],
              gate: int | None = None) -> tuple[list[str], dict[str, str]]:
    """The bash command line that joins the groups of `fds`, waits for a line on `gate`
    if given, and then runs the agent with `env`; and the environment to start it with.
    Only where `usable(executable, env)`.

    Args:
        executable: the agent's program, absolute (`resolve_executable`).
        argv: the agent's argv; argv[0] is kept as it is.
        env: the agent's whole environment.
        fds: `cgroup.procs` fds open for writing, passed to the stub (`pass_fds`).
        gate: the read end of a pipe, passed too: the program runs once a line is
            written to it, never if its write end closes first.
    """
    restore = [f"export {name}={shlex.quote(env[name])}" if name in env else f"unset {name}"
               for name in RESTORED_NAMES]
    restore += [f"export {name}={shlex.quote(env[name])} 2>/dev/null" for name in QUIET_NAMES if name in env]
    underscore = f"_={shlex.quote(env['_'])} " if "_" in env else ""
    script = _JOIN + "; ".join(restore) + f'; {underscore}exec -a "$0" "$1" "${{@:4}}"'
    start_env = {name: value for name, value in env.items() if name not in QUIET_NAMES}
    assert _BASH is not None, "stub_argv without usable()"
    return [_BASH, "--norc", "--noprofile", "-c", script, argv[0], executable,
            " ".join(str(fd) for fd in fds), "" if gate is None else str(gate), *argv[1:]], start_env


def _plain_env(env: Mapping[str, str]) -> bool:
    for name in env:
        if name in SPECIAL_NAMES or name.startswith(SPECIAL_PREFIXES):
            return False
    if any(len(env.get(name, "")) > MAX_RESTORED_CHARS for name in (*RESTORED_NAMES, *QUIET_NAMES, "_")):
        return False
    shlvl = env.get("SHLVL")
    return shlvl is None or (shlvl.isdigit() and shlvl.isascii() and str(int(shlvl)) == shlvl
                             and int(shlvl) <= MAX_SHLVL)


def _plain_program(executable: str) -> bool:
    """True when exec of `executable` will plainly work: an ELF binary, or a `#!`
    script whose interpreter is an executable file."""
    try:
        with open(executable, "rb") as handle:
            head = handle.read(HEADER_BYTES)
    except OSError:
        return False  # e.g. execute-only: let exec itself judge it
    if head.startswith(b"\x7fELF"):
        return True
    if not head.startswith(b"#!"):
        return False
    words = head[2:].split(b"\n", 1)[0].split()
    if not words or not words[0].startswith(b"/"):
        return False
    interpreter = os.fsdecode(words[0])
    return os.path.isfile(interpreter) and os.access(interpreter, os.X_OK)


__all__ = ["BASH_PATHS", "SPECIAL_NAMES", "find_bash", "joiner", "stub_argv", "usable"]
