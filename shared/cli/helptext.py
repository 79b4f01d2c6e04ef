"""The `--help` of both CLIs as a person reads it: commands in workflow order,
their summaries whole (never cut at 45 characters with "..."), one example per
command, and no references into PROTOCOL.md (they stay in the code's docstrings;
`strip_refs` takes them out of every help screen, whichever module wrote it)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from typer.core import TyperGroup

try:  # typer >= 0.2x vendors click; older versions depend on it
    from typer._click.core import Command, Context
    from typer._click.formatting import HelpFormatter
except ImportError:  # pragma: no cover
    from click.core import Command, Context  # type: ignore[import-not-found, no-redef, assignment, unused-ignore]
    from click.formatting import HelpFormatter  # type: ignore[import-not-found, no-redef, assignment, unused-ignore]

SUMMARY_MAX_CHARS = 10_000  # a command's first sentence, whole
_REF = r"(?:PROTOCOL\s+)?§\s?[\d.]*\d(?:\s*(?:,|and|/|-)\s*§?\s?[\d.]*\d)*"
_ONLY_REFS = re.compile(r"[ \t]*\(\s*" + _REF + r"\s*\)")
_LEADING_REF = re.compile(r"\(\s*" + _REF + r"\s*[;,:]?\s*")
_ANY_REF = re.compile(r"[,;]?[ \t]*" + _REF)


def strip_refs(text: str) -> str:
    """`text` without `PROTOCOL §N` / `(§N)` references."""
    return _ANY_REF.sub("", _LEADING_REF.sub("(", _ONLY_REFS.sub("", text)))


class PlainFormatter(HelpFormatter):
    """A help formatter that takes PROTOCOL references out of texts before wrapping them."""

    def write_text(self, text: str) -> None:
        super().write_text(strip_refs(text))

    def write_dl(self, rows: Sequence[tuple[str, str]], col_max: int = 30, col_spacing: int = 2) -> None:
        super().write_dl([(term, strip_refs(text)) for term, text in rows], col_max, col_spacing)


class PlainContext(Context):
    """Every help screen of our CLIs is formatted by `PlainFormatter`."""

    formatter_class = PlainFormatter


class WorkflowGroup(TyperGroup):
    """Commands listed in `order` (others after, as added), whole summaries, and an
    `Example:` epilog from `examples` for each command that has none."""

    context_class = PlainContext
    order: ClassVar[Sequence[str]] = ()
    examples: ClassVar[Mapping[str, str]] = {}

    def list_commands(self, ctx: Context) -> list[str]:
        known = {name: n for n, name in enumerate(self.order)}
        return sorted(self.commands, key=lambda name: known.get(name, len(known)))

    def get_command(self, ctx: Context, cmd_name: str) -> Command | None:
        cmd = super().get_command(ctx, cmd_name)
        if cmd is not None:
            cmd.context_class = PlainContext
            example = self.examples.get(cmd_name)
            if example and not cmd.epilog:
                cmd.epilog = f"\b\nExample: {example}"
        return cmd

    def format_commands(self, ctx: Context, formatter: HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(SUMMARY_MAX_CHARS)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def workflow_group(order: Sequence[str], examples: Mapping[str, str]) -> type[WorkflowGroup]:
    """A `WorkflowGroup` class for one typer app (`typer.Typer(cls=...)`)."""
    attrs: dict[str, Any] = {"order": tuple(order), "examples": dict(examples)}
    return type("Workflow", (WorkflowGroup,), attrs)
