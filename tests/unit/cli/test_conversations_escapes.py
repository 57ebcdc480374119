"""What people and models wrote reaches the operator's terminal as text: escape sequences in a title, a summary
or a message are printed escaped by the conversation commands, and Rich markup in them is printed as written."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenex_daemon.cli.output import printable
from tenex_daemon.cli.send_command import _reply_printer
from tenex_daemon.core.conversation import TitleSource
from tenex_daemon.services.conversation_manager import ConversationManager
from tenex_daemon.testing import EventFactory, make_agent
from tests.unit.cli.conftest import tenexd
from tests.unit.cli.test_cli import seed_conversation, tenexd_json
from tests.unit.cli.test_conversations_stop import on_store

HOSTILE = "Lunch\x1b]0;PWNED\x1b\\\x1b[2K\x1b[1A\x1b]52;c;ZWNobyBoaQ==\x07\x9b2J [bold]ok[/x] :rocket:"
"""A title that sets the window's title, erases and climbs a line, writes the clipboard (OSC 52), clears the
screen with an 8-bit CSI and holds Rich markup and an emoji code."""


def test_printable_escapes_control_characters_but_line_feed_and_tab() -> None:
    """Each C0 and C1 control character and DEL is written as a visible ``\\xNN``; line feed, tab and the
    rest of the text are kept."""
    assert printable("a\x1b[1Ab\x00\r\x7f\x85\x9b\tc\nd é") == "a\\x1b[1Ab\\x00\\x0d\\x7f\\x85\\x9b\tc\nd é"
    assert printable(42) == "42"


def test_list_and_show_print_no_escape_sequence_of_a_title_or_a_message(home: Path) -> None:
    """`conversations list`, `show` and `context` print a hostile title and message with no ESC byte (nor
    the 8-bit CSI), escaped where it stood, markup and emoji codes as written; ``--json`` keeps them."""
    conversation = seed_conversation(home, HOSTILE, f"Hi {HOSTILE}")

    printed = {
        args[0]: tenexd(home, *args)
        for args in (
            ("conversations", "list"),
            ("conversations", "show", conversation),
            ("context", conversation, "--agent", "planner"),
        )
    }

    for command, (code, output) in printed.items():
        assert code == 0, output
        assert "\x1b" not in output, command
        assert "\x9b" not in output, command
        assert "\x07" not in output, command
        assert "Lunch\\x1b]0;PWNED\\x1b" in output, command
    show = printed["conversations"][1]
    assert "\\x9b2J [bold]ok[/x] :rocket:" in show
    assert tenexd_json(home, "conversations", "show", conversation)["title"] == HOSTILE


def test_show_prints_a_summary_and_an_end_reason_escaped(home: Path) -> None:
    """A summary (a model's) and an end's reason holding escape sequences are shown escaped."""
    conversation = seed_conversation(home, "Picnic", "Plan a picnic")

    async def describe(manager: ConversationManager) -> None:
        await manager.describe(conversation, title=None, summary=HOSTILE, source=TitleSource.MODEL, for_activity=0)

    on_store(home, describe)
    code, ended = tenexd(home, "conversations", "end", conversation, "--reason", HOSTILE)
    assert code == 0, ended
    code, output = tenexd(home, "conversations", "show", conversation)

    assert code == 0, output
    assert "\x1b" not in output
    assert output.count("Lunch\\x1b]0;PWNED") == 2


def test_send_prints_an_agents_reply_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    """`tenexd send` waiting for replies prints a model's hostile text with no ESC byte, escaped where it
    stood, after the agent's name."""
    agent, keys = make_agent("planner", "Planner", 11)
    reply = EventFactory().event(keys, HOSTILE)

    _reply_printer([agent], as_json=False)(agent, reply)

    printed = capsys.readouterr().out
    assert "\x1b" not in printed
    assert "\x9b" not in printed
    assert printed.startswith("[Planner] Lunch\\x1b]0;PWNED")
