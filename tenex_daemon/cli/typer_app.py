"""The typer app tenexd's command line is made of, :class:`TenexTyper`: the app and each group of commands.

Two things it does for every command, in this one place:

- Its help says what a person types. Typer 0.29 labels each value with its Python type instead (``--json
  <bool>`` for a flag that takes no value, ``--phase <str>``, ``--relay <list[str]>``, ``--limit <int
  range>``, an argument ``{text}`` in the usage line); here a flag shows nothing, a text ``TEXT``
  (repeatable too), a number ``INTEGER`` or ``FLOAT`` (its range after it), a file ``PATH``, a choice
  its values, and the usage line names each argument (``ID``, ``[ID]`` when it may be left out).
- Its entry point (the ``tenexd`` script calls the app) ends quietly when the reader of its output went
  away, as standard Unix tools do (``tenexd status | head -1``): exit status 0 and nothing on stderr,
  where a broken pipe made it exit 1 (Click's handler, rich's), or, when the output was still buffered
  at exit, print ``BrokenPipeError`` and exit 120 (the interpreter's last flush). Output that cannot be
  written for another reason (``> /dev/full``, a full disk) ends it with one line saying so and exit 1,
  not a traceback.
"""

from __future__ import annotations

import inspect
import os
import select
import sys
from collections.abc import Callable
from datetime import datetime
from enum import Enum
from pathlib import PurePath
from typing import TYPE_CHECKING, Any, Final, NoReturn, get_args
from uuid import UUID

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

if TYPE_CHECKING:
    from typer._click import Context, Parameter
    from typer.models import CommandFunctionType

_TYPE_NAMES: Final[dict[type, str]] = {
    str: "TEXT", bool: "BOOLEAN", int: "INTEGER", float: "FLOAT", datetime: "DATETIME", UUID: "UUID",
}
"""Click's names of the value types (what Typer showed before 0.29)."""
_PATH_NAMES: Final = {"file": "FILE", "dir": "DIRECTORY"}


def _type_name(annotation: Any) -> str:
    """The name of one value of ``annotation``: TEXT, INTEGER, PATH..."""
    if not isinstance(annotation, type):
        return "VALUE"
    if annotation in _TYPE_NAMES:
        return _TYPE_NAMES[annotation]
    if issubclass(annotation, PurePath):
        return "PATH"
    return annotation.__name__.upper()


def value_metavar(param: TyperOption | TyperArgument) -> str:
    """What a person types for one value of ``param``: ``TEXT``, ``INTEGER``, ``PATH``, ``[a|b]`` for a
    choice (a list's or a tuple's items named the same way)."""
    descriptor = param.type_descriptor
    choices = descriptor.choices
    if choices:
        return "[" + "|".join(str(c.value if isinstance(c, Enum) else c) for c in choices) + "]"
    if descriptor.is_path:
        return _PATH_NAMES.get(descriptor.path_type, "PATH")
    annotation = descriptor.annotation
    if descriptor.is_list or descriptor.is_tuple:
        items = [item for item in get_args(annotation) if item is not Ellipsis]
        return " ".join(_type_name(item) for item in items) if items else "TEXT"
    return _type_name(annotation)


class PlainOption(TyperOption):
    """An option whose help shows what it takes: nothing for a flag, else its metavar (given, or
    :func:`value_metavar`)."""

    def display_type_rich(self, ctx: Context) -> str | None:
        """What the option takes, as its help shows it (None for a flag)."""
        if self.metavar is not None:
            return self.metavar
        if self.is_flag or self.count:
            return None
        metavar = value_metavar(self)
        return f"{metavar}..." if self.nargs != 1 else metavar


class PlainArgument(TyperArgument):
    """An argument whose help shows its value's type as :func:`value_metavar` names it, and whose usage
    piece is its name (its metavar, else its name in capitals), in brackets when it may be left out; an
    error names it the same way."""

    def display_type_rich(self, ctx: Context) -> str | None:
        """The argument's value type, as its help shows it."""
        return value_metavar(self)

    def usage_name(self) -> str:
        """The argument's name in the usage line and in errors: its metavar, else its name in capitals."""
        return self.metavar or (self.name or "").upper()

    def get_usage_pieces(self, ctx: Context) -> list[str]:
        """``NAME``, ``[NAME]`` when optional, ``NAME...`` when it takes several."""
        name = self.usage_name()
        if not self.required and not (name.startswith("[") and name.endswith("]")):
            name = f"[{name}]"
        return [f"{name}..." if self.nargs != 1 else name]

    def get_error_hint(self, *ctx: Any) -> str:
        """How an error names the argument (``Missing argument 'TEXT'.``): as the usage line does (Click
        passes the context, Typer's own Click does not)."""
        return f"'{self.usage_name()}'"


def plain_params(params: list[Parameter]) -> list[Parameter]:
    """Make Typer's options and arguments in ``params`` show what a person types in help (their class
    becomes :class:`PlainOption` or :class:`PlainArgument`, which change only how they are shown)."""
    for param in params:
        if type(param) is TyperOption:
            param.__class__ = PlainOption
        elif type(param) is TyperArgument:
            param.__class__ = PlainArgument
    return params


def one_line_summary(command: TyperCommand | TyperGroup) -> None:
    """Give ``command`` the first paragraph of its help, on one line, as the summary its group's listing
    shows: Typer's listing keeps the paragraph's line breaks (a docstring's), which then cut its row
    mid-sentence ("degraded" / "(the reason is shown)"). A summary given is kept."""
    if command.short_help is None and command.help:
        paragraph = inspect.cleandoc(command.help).partition("\f")[0].split("\n\n")[0]
        command.short_help = " ".join(paragraph.split())
    if command.help:
        command.help = flowing(command.help)


def flowing(help_text: str) -> str:
    """``help_text`` with each paragraph on one line, for the help to wrap at the terminal's width: the help
    keeps a docstring's line breaks after its first paragraph, cutting lines mid-sentence ("and the" /
    "settings' error"); a paragraph marked ``\\b`` (kept as written) stays so. A docstring's double
    backquotes show as single ones."""
    text, cut, rest = inspect.cleandoc(help_text).partition("\f")
    paragraphs = [p if p.startswith("\b") else " ".join(p.split()) for p in text.split("\n\n")]
    return "\n\n".join(paragraphs).replace("``", "`") + cut + rest


class TenexCommand(TyperCommand):
    """A command whose help shows what a person types (its parameters and its help option), whose summary in
    its group's listing is one line (:func:`one_line_summary`), and which says in one line, exit 2, that a
    file of the home is not this user's to read or write."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """A Typer command, its summary made one line."""
        super().__init__(*args, **kwargs)
        one_line_summary(self)

    def get_params(self, ctx: Context) -> list[Parameter]:
        """The command's parameters, then its help option, shown as a person types them."""
        return plain_params(super().get_params(ctx))

    def invoke(self, ctx: Context) -> Any:
        """Run the command; a file or folder this user may not read or write (a home made by the user the
        daemon runs as) is one error line and exit 2 (configuration), not a traceback or a wrong verdict;
        so is a text given that is not UTF-8 (a message, a name, a reason), before anything is written."""
        undecodable = _not_utf8(ctx)
        if undecodable is not None:
            from tenex_daemon.cli.output import EXIT_USAGE, fail

            fail(f"{undecodable}: the text is not valid UTF-8 (check the terminal's encoding)", EXIT_USAGE)
        try:
            return super().invoke(ctx)
        except PermissionError as exc:
            from tenex_daemon.cli.output import EXIT_USAGE, fail

            where = f" {exc.filename}" if exc.filename else ""
            fail(f"permission denied:{where} (run tenexd as the user the daemon runs as)", EXIT_USAGE)


PATH_PARAMS: Final = frozenset({"home"})
"""Parameters that are paths typed as text (``--home``): a Linux path may hold any bytes."""


def _not_utf8(ctx: Context) -> str | None:
    """How a person gave the first text value of the command that is not UTF-8 (``--name``, ``TEXT``), or
    None. Python hands the command line's undecodable bytes over as lone surrogates, which every later
    write (config.toml, an event, a request) refuses; a path may hold such bytes (it is not text)."""
    for param in ctx.command.params:
        if param.name in PATH_PARAMS:
            continue
        value = ctx.params.get(param.name or "")
        texts = value if isinstance(value, list | tuple) else (value,)
        for text in texts:
            if isinstance(text, str) and not _encodes(text):
                flags = [name for name in getattr(param, "opts", ()) if name.startswith("--")]
                return flags[0] if flags and param.param_type_name == "option" else (param.name or "").upper()
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class TenexGroup(TyperGroup):
    """A group of commands whose own help shows what a person types, its summary one line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """A Typer group, its summary made one line."""
        super().__init__(*args, **kwargs)
        one_line_summary(self)

    def get_params(self, ctx: Context) -> list[Parameter]:
        """The group's parameters, then its help option, shown as a person types them."""
        return plain_params(super().get_params(ctx))


class TenexTyper(typer.Typer):
    """A typer app (tenexd, or a group of its commands) whose commands are :class:`TenexCommand` and groups
    :class:`TenexGroup`; called as the entry point, it ends quietly when the reader of its output went
    away."""

    def __init__(self, **settings: Any) -> None:
        """A ``typer.Typer(**settings)``, its group a :class:`TenexGroup` unless ``cls`` says otherwise."""
        settings.setdefault("cls", TenexGroup)
        super().__init__(**settings)

    def command(
        self, name: str | None = None, *, cls: type[TyperCommand] | None = None, **settings: Any
    ) -> Callable[[CommandFunctionType], CommandFunctionType]:
        """Register a command as ``typer.Typer.command`` does, a :class:`TenexCommand` unless ``cls`` says
        otherwise."""
        return super().command(name, cls=cls or TenexCommand, **settings)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the command line (``sys.argv``). When its output's reader went away (stdout a pipe nobody
        reads), a broken pipe ends it with exit 0 and nothing on stderr; a status it set already (a failed
        command's 1) is kept, and a broken pipe that is not stdout's is left to fail as any error does.
        Another failure to write stdout ends it with ``error: cannot write the output: ...`` and exit 1."""
        with _StdoutWatch() as stdout, _OutputErrors():
            try:
                result = super().__call__(*args, **kwargs)
            except OutputError as exc:
                from tenex_daemon.cli.output import EXIT_FAILURE, err

                err.print(f"error: cannot write the output: {exc.strerror or exc}")
                _reader_went_away(EXIT_FAILURE)
            except BrokenPipeError:
                if stdout.reader_gone():
                    _reader_went_away(0)
                raise
            except SystemExit as exc:
                # Click's handler of a broken pipe exits 1, so does rich's (Console.on_broken_pipe): both
                # while handling the BrokenPipeError; any other exit keeps its status
                gone = isinstance(exc.__context__, BrokenPipeError) and stdout.reader_gone()
                if gone or not _flushed():
                    _reader_went_away(0 if gone else exc.code)
                raise
            if not _flushed():
                _reader_went_away(0)
            return result


class OutputError(OSError):
    """Writing stdout failed, for another reason than its reader going away (a full disk, ``/dev/full``)."""


class _Output:
    """``sys.stdout`` while a command runs: a write or flush that fails, other than with a broken pipe, raises
    :class:`OutputError` (told apart from the command's own errors); the rest is the stream's."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(exc.errno, exc.strerror) from exc

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(exc.errno, exc.strerror) from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _OutputErrors:
    """Puts :class:`_Output` in the place of ``sys.stdout`` while a command runs, then the stream back."""

    def __enter__(self) -> None:
        self._stream = sys.stdout
        if self._stream is not None:
            sys.stdout = _Output(self._stream)

    def __exit__(self, *_: object) -> None:
        if isinstance(sys.stdout, _Output):
            sys.stdout = self._stream


class _StdoutWatch:
    """Keeps a duplicate of stdout's descriptor while a command runs, to tell afterwards whether its reader
    went away (rich points stdout at /dev/null once a write to it fails, so stdout itself no longer says)."""

    def __init__(self) -> None:
        self._descriptor: int | None = None

    def __enter__(self) -> _StdoutWatch:
        try:
            self._descriptor = os.dup(sys.stdout.fileno())
        except (AttributeError, OSError, ValueError):  # no stdout, or not a file: no pipe to watch
            self._descriptor = None
        return self

    def __exit__(self, *_: object) -> None:
        if self._descriptor is not None:
            os.close(self._descriptor)

    def reader_gone(self) -> bool:
        """Whether stdout was a pipe whose reading end is closed (poll reports an error on its writing
        end)."""
        if self._descriptor is None:
            return False
        poller = select.poll()
        poller.register(self._descriptor, 0)  # no events asked: an error or a hang-up is reported anyway
        return any(events & select.POLLERR for _, events in poller.poll(0))


def _flushed() -> bool:
    """Flush what stdout still buffers, as the interpreter would at exit, while a broken pipe can still be
    handled: False when its reader went away (a broken pipe); another failure is left to the interpreter's
    own flush to report."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return False
    except (AttributeError, OSError, ValueError):  # None, another failure, closed
        pass
    return True


def _reader_went_away(status: int | str | None) -> NoReturn:
    """Exit with ``status``, stdout pointed at /dev/null first: what it still buffers then goes nowhere,
    rather than failing again in the interpreter's last flush (which prints the error and exits 120)."""
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # no stdout, or not a file: nothing will be flushed to it
        pass
    else:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, descriptor)
        finally:
            os.close(devnull)
    raise SystemExit(status) from None
