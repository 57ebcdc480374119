"""The hardening issue's defects, each mapped to the tests written to fail before its fix (commit c520245 for
defect 1, 6c19c8a for defects 2 to 8), checked to exist so the map cannot rot; defects 1 and 2 are also
tried against the real daemon: a person's ``claude-session`` tag on the ``claude`` command line, and the
TCP control API asked without its token, from another host and from another origin."""

from __future__ import annotations

import ast
import json
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tenex_daemon.adapters.nostr.signer import Signer
from tests.e2e.harness import set_agent_backend
from tests.evidence import record
from tests.integration.nostr.harness import LocalRelayServer, free_port
from tests.security.conftest import (
    log_records,
    make_home,
    publish,
    replies_to,
    running,
    signed,
    wait_for_events,
)

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Defect:
    """A defect of the hardening issue: what it was, the commit that fixed it, the node ids of the tests
    that fail on that commit's parent (``tests``), those added with the fix that passed before it too and pin
    what the fix must keep (``guards``), and the security tests that try it on the real daemon.

    Checked once by hand: the fixing commit's test files run on its parent's tree (``git archive``)."""

    what: str
    fixed_in: str
    tests: tuple[str, ...]
    end_to_end: tuple[str, ...] = ()
    guards: tuple[str, ...] = ()


DEFECTS: dict[int, Defect] = {
    1: Defect(
        "a person's claude-session tag reached `claude --resume` (an option injected, another's session resumed)",
        "c520245",
        (
            "tests/unit/core/test_sessions_and_phases.py::test_a_session_id_from_another_persons_event_is_never_taken",
            "tests/unit/core/test_sessions_and_phases.py::test_a_malformed_session_id_is_never_taken",
            "tests/unit/core/test_sessions_and_phases.py::test_an_agents_session_tag_is_taken",
            "tests/unit/llm/test_claude_code_stream.py::test_a_malformed_session_id_never_reaches_the_command_line",
            "tests/unit/llm/test_claude_code_stream.py::test_a_session_id_is_one_argument_joined_to_its_option",
        ),
        ("tests/security/test_defects.py::test_a_persons_claude_session_tag_never_reaches_the_claude_command_line",),
    ),
    2: Defect(
        "the TCP control API answered without a token and to any Host or Origin",
        "6c19c8a",
        (
            "tests/unit/app/test_control_security.py::test_tcp_needs_the_token",
            "tests/unit/app/test_control_security.py::test_dns_rebinding_host_is_refused",
            "tests/unit/app/test_control_security.py::test_cross_site_post_is_refused",
            "tests/unit/app/test_control_security.py::test_cross_origin_is_refused_even_with_the_token",
            "tests/unit/app/test_control_security.py::test_refusals_are_counted_by_reason",
            "tests/unit/app/test_control_security.py::test_token_file_is_created_0600_and_kept",
            "tests/unit/app/test_control_security.py::test_token_file_readable_by_others_is_refused",
        ),
        ("tests/security/test_defects.py::test_the_tcp_control_api_refuses_no_token_other_hosts_and_other_origins",),
    ),
    3: Defect(
        "a corrupt complete log line was deleted as if it were a torn tail",
        "6c19c8a",
        (
            "tests/unit/storage/test_hardening_storage.py::test_corrupt_complete_last_line_is_copied_to_corrupt_before_the_cut",
            "tests/unit/storage/test_hardening_storage.py::test_corrupt_complete_line_past_the_indexed_size_is_kept_with_its_torn_tail",
            "tests/unit/storage/test_hardening_storage.py::test_checksummed_line_that_is_not_an_event_is_kept_and_reported",
        ),
        guards=("tests/unit/storage/test_hardening_storage.py::test_unterminated_last_line_alone_is_still_a_torn_tail",),
    ),
    4: Defect(
        "PostgreSQL refused events holding \\u0000",
        "6c19c8a",
        (
            "tests/contract/test_store_contract.py::test_nul_characters_round_trip_exactly[postgres]",
            "tests/contract/test_store_contract.py::test_postgres_migration_keeps_rows_stored_as_jsonb",
        ),
    ),
    5: Defect(
        "a frame over 4 MiB made the pool reconnect forever",
        "6c19c8a",
        (
            "tests/unit/nostr/test_hardening_transport.py::test_a_5_mib_event_frame_is_rejected_by_the_codec_without_closing_the_connection",
            "tests/unit/nostr/test_hardening_transport.py::test_a_frame_over_the_transport_limit_is_skipped_past_instead_of_replayed_forever",
        ),
    ),
    6: Defect(
        "write failures (ENOSPC) left events unaccepted while the status said healthy",
        "6c19c8a",
        ("tests/unit/app/test_degraded.py::test_events_whose_store_writes_failed_are_retried_once_writes_work",),
    ),
    7: Defect(
        "a whitelisted person could read the owner's thread through the agents; people were not labelled",
        "6c19c8a",
        (
            "tests/unit/services/test_thread_privacy.py::test_a_whitelisted_person_cannot_reply_into_the_owners_conversation",
            "tests/unit/services/test_thread_privacy.py::test_the_setting_lets_whitelisted_people_join",
            "tests/unit/services/test_thread_privacy.py::test_owner_joins_any_and_people_keep_their_own",
            "tests/unit/services/test_thread_privacy.py::test_a_person_the_owner_p_tags_is_invited",
            "tests/unit/services/test_thread_privacy.py::test_a_fetched_root_of_the_owner_does_not_let_a_person_in",
            "tests/unit/core/test_people_labels.py::test_person_label_is_the_short_npub",
            "tests/unit/core/test_people_labels.py::test_two_people_are_labelled_in_history_and_trigger",
            "tests/unit/core/test_people_labels.py::test_one_person_stays_unlabelled",
            "tests/unit/core/test_people_labels.py::test_memoized_history_is_relabelled_when_a_second_person_writes",
            "tests/unit/core/test_people_labels.py::test_a_trigger_from_a_second_person_not_yet_in_history_labels_everyone",
        ),
        (
            "tests/security/test_allow_list.py::"
            "test_the_owner_and_a_whitelisted_person_are_answered_the_person_only_where_they_belong",
        ),
    ),
    8: Defect(
        "created_at unbounded; strangers' events cost disk and author_not_allowed was never logged; no pool "
        "metrics; a deep JSON body was a 500; key-mode refusals exited 1; a 0755 keys/ was accepted; the "
        "storage.path docstring was wrong; state.json repeated a message of the history",
        "6c19c8a",
        (
            "tests/unit/storage/test_hardening_storage.py::test_event_from_the_far_future_is_refused_at_intake",
            "tests/unit/storage/test_hardening_storage.py::test_time_display_survives_absurd_values",
            "tests/unit/app/test_degraded.py::test_a_strangers_event_is_not_written_to_the_processed_ledger",
            "tests/unit/app/test_degraded.py::test_author_not_allowed_is_logged_once_per_author_per_minute",
            "tests/unit/app/test_degraded.py::test_metrics_show_frame_rejects_duplicates_handler_errors_and_reconnects",
            "tests/unit/app/test_control_security.py::test_deeply_nested_body_is_a_400",
            "tests/unit/cli/test_key_modes.py::test_run_refuses_a_key_file_readable_by_others_with_exit_2",
            "tests/unit/cli/test_key_modes.py::test_run_refuses_a_keys_folder_others_may_enter_with_exit_2",
            "tests/unit/cli/test_key_modes.py::test_a_key_in_a_folder_open_to_others_is_refused_naming_the_folder",
            "tests/unit/storage/test_hardening_storage.py::test_storage_path_docstring_matches_where_the_store_puts_conversations",
            "tests/unit/storage/test_hardening_storage.py::test_state_json_does_not_repeat_a_message_of_the_history",
        ),
        (
            "tests/security/test_allow_list.py::"
            "test_a_strangers_flood_is_never_answered_costs_no_disk_and_is_logged_and_counted",
            "tests/security/test_allow_list.py::test_unreadable_gift_wraps_from_anyone_cost_no_disk",
            "tests/security/test_forged_and_replayed.py::test_forged_events_are_refused_with_their_reason_and_never_answered",
            "tests/security/test_defects.py::test_the_tcp_control_api_refuses_no_token_other_hosts_and_other_origins",
        ),
        guards=(
            "tests/unit/storage/test_hardening_storage.py::test_event_a_little_ahead_of_now_is_accepted",
            "tests/unit/storage/test_hardening_storage.py::test_a_last_user_message_not_in_the_history_stays_in_the_snapshot",
        ),
    ),
}


def defined_tests(path: Path) -> set[str]:
    """The test functions a file defines, as ``name`` (module level) and ``Class::name`` (in classes)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found.add(node.name)
        elif isinstance(node, ast.ClassDef):
            found |= {
                f"{node.name}::{item.name}" for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            }
    return found


def test_every_defect_maps_to_tests_that_exist() -> None:
    """Defects 1 to 8 each name at least one failing-first test, and every named test file and function exists."""
    assert sorted(DEFECTS) == list(range(1, 9))
    missing = []
    for number, defect in DEFECTS.items():
        assert defect.tests, f"defect {number} names no test"
        for node_id in (*defect.tests, *defect.end_to_end, *defect.guards):
            file, _, name = node_id.partition("::")
            name = name.partition("[")[0]  # one parametrization of a test
            path = REPO / file
            if not path.is_file() or not name or name not in defined_tests(path):
                missing.append(node_id)
    assert missing == [], f"mapped tests that do not exist: {missing}"
    record("security.defects", defects=len(DEFECTS), tests=sum(len(d.tests) for d in DEFECTS.values()),
           guards=sum(len(d.guards) for d in DEFECTS.values()),
           end_to_end=len({t for d in DEFECTS.values() for t in d.end_to_end}))


# --- defect 1, against the real daemon ----------------------------------------------------------------------

STAND_IN = """#!{python}
import json, os, sys
args = sys.argv[1:]
prompt = sys.stdin.read()
with open(os.environ["FAKE_CLAUDE_LOG"], "a") as log:
    log.write(json.dumps({{"args": args, "stdin": prompt}}) + "\\n")
session = next((a.split("=", 1)[1] for a in args if a.startswith("--resume=")), "sess-new-1")
for event in (
    {{"type": "system", "subtype": "init", "session_id": session, "model": "claude-stand-in"}},
    {{"type": "assistant", "session_id": session, "message": {{"content": [{{"type": "text", "text": "Done."}}]}}}},
    {{"type": "result", "subtype": "success", "is_error": False, "result": "Done.", "session_id": session,
     "usage": {{"input_tokens": 4, "output_tokens": 1}}}},
):
    print(json.dumps(event), flush=True)
"""
INJECTED = "--dangerously-skip-permissions"


@pytest.mark.integration
@pytest.mark.slow
async def test_a_persons_claude_session_tag_never_reaches_the_claude_command_line(
    relay: LocalRelayServer, tmp_path: Path
) -> None:
    """With a ``claude`` on PATH recording its argv, an option sent as the owner's ``claude-session`` tag never
    reaches it, a whitelisted person's well-formed tag naming the owner's session is not resumed, and the
    agent's own session is resumed as one ``--resume=<id>`` argument."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "claude-calls.jsonl"
    bin_dir.mkdir()
    claude = bin_dir / "claude"
    claude.write_text(STAND_IN.format(python=sys.executable))
    claude.chmod(0o755)
    person = Signer.generate(label="whitelisted")
    home = make_home(tmp_path / "home", [relay.url], whitelist=[person.pubkey])
    set_agent_backend(home, "planner", 'kind = "claude-code"\noptions = { timeout = 30 }')
    owner, planner = Signer.from_text(home.owner_secret), home.agent("planner")
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "FAKE_CLAUDE_LOG": str(calls)}

    async with running(home, env):
        owners = signed(owner, 11, "Owner: plan it", [["p", planner], ["claude-session", INJECTED]])
        await publish(relay.url, [owners])
        [first] = await wait_for_events(relay.url, replies_to(owners["id"], [planner]), 1)
        persons = signed(person, 11, "Person: resume theirs", [["p", planner], ["claude-session", "sess-new-1"]])
        await publish(relay.url, [persons])
        await wait_for_events(relay.url, replies_to(persons["id"], [planner]), 1)
        thread = [["E", owners["id"], "", owner.pubkey], ["K", "11"], ["P", owner.pubkey],
                  ["e", owners["id"], "", owner.pubkey], ["k", "11"], ["p", planner]]
        again = signed(owner, 1111, "Owner: go on", [*thread, ["claude-session", INJECTED]])
        await publish(relay.url, [again])
        await wait_for_events(relay.url, replies_to(owners["id"], [planner]), 2)

    argvs: list[list[str]] = [json.loads(line)["args"] for line in calls.read_text().splitlines()]
    assert len(argvs) == 3, argvs
    assert ["claude-session", "sess-new-1"] in first["tags"], "the agent's session is tagged on its reply"
    assert [a for argv in argvs for a in argv if "dangerously" in a] == [], argvs
    resumes = [[a for a in argv if a.startswith("--resume")] for argv in argvs]
    assert resumes == [[], [], ["--resume=sess-new-1"]], resumes
    record("security.defect1", claude_calls=len(argvs), injected_options=0, foreign_resumes=0)


# --- defect 2, against the real daemon ----------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.slow
async def test_the_tcp_control_api_refuses_no_token_other_hosts_and_other_origins(
    relay: LocalRelayServer, tmp_path: Path
) -> None:
    """The real daemon's TCP control API answers 401 without its token or with a wrong one, 403 to another
    Host, another Origin or a cross-site fetch (a cross-site POST archives nothing), logs and counts each
    refusal, keeps its token file 0600, serves the right request, and answers a too-deep JSON body 400."""
    home = make_home(tmp_path / "home", [relay.url])
    owner, planner = Signer.from_text(home.owner_secret), home.agent("planner")
    port = free_port()
    base, good_host = f"http://127.0.0.1:{port}", f"127.0.0.1:{port}"
    async with running(home, {"TENEX_CONTROL__TCP_PORT": str(port)}):
        root = signed(owner, 11, "Secret plans", [["p", planner]])
        await publish(relay.url, [root])
        await wait_for_events(relay.url, replies_to(root["id"], [planner]), 1)
        token_file = home.path / "run" / "control.token"
        token = token_file.read_text().strip()
        bearer = {"Authorization": f"Bearer {token}"}
        conversation = f"/api/v1/conversations/{root['id']}"
        attempts: list[tuple[str, str, dict[str, str], int, str | None]] = [
            ("GET", conversation, {}, 401, "no_token"),
            ("GET", "/metrics", {}, 401, "no_token"),
            ("GET", conversation, {"Authorization": "Bearer " + "A" * 43}, 401, "bad_token"),
            ("GET", conversation, {**bearer, "Host": f"evil.example:{port}"}, 403, "bad_host"),
            ("GET", conversation, {**bearer, "Origin": "http://evil.example"}, 403, "cross_origin"),
            ("GET", conversation, {**bearer, "Origin": "null"}, 403, "cross_origin"),
            ("GET", conversation, {**bearer, "Sec-Fetch-Site": "cross-site"}, 403, "cross_origin"),
            ("POST", f"{conversation}/archive", {"Origin": "http://evil.example"}, 403, "cross_origin"),
            ("GET", conversation, {**bearer, "Host": f"localhost:{port}"}, 200, None),
            ("GET", conversation, {**bearer, "Origin": f"http://{good_host}"}, 200, None),
        ]
        answers: list[tuple[int, Any]] = []
        async with aiohttp.ClientSession() as session:
            for method, path, headers, _, _ in attempts:
                async with session.request(method, base + path, headers=headers) as answer:
                    text = await answer.text()
                    answers.append((answer.status, json.loads(text) if text.startswith("{") else text[:200]))
            deep = "[" * 30_000 + "]" * 30_000
            async with session.post(base + f"{conversation}/reset", data=deep,
                                    headers={**bearer, "Content-Type": "application/json"}) as answer:
                deep_status = answer.status
            async with session.get(base + conversation, headers=bearer) as answer:
                archived = (await answer.json())["archived"]
            async with session.get(base + "/metrics", headers=bearer) as answer:
                metrics = await answer.text()

    for (method, path, _, status, reason), (got, body) in zip(attempts, answers, strict=True):
        assert got == status, f"{method} {path}: {got} {str(body)[:300]}"
        if reason is not None:
            assert body["reason"] == reason
    assert archived is False, "the cross-site POST archived nothing"
    assert deep_status == 400
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    refused = [r["reason"] for r in log_records(home) if r.get("event") == "control_request_refused"]
    wanted = [reason for *_, reason in attempts if reason is not None]
    assert sorted(refused) == sorted(wanted)
    for reason in set(wanted):
        line = f'tenexd_control_requests_refused_total{{reason="{reason}"}} {float(wanted.count(reason))}'
        assert line in metrics, line
    record("security.defect2", requests=len(attempts) + 1, refused=len(wanted), served=len(attempts) - len(wanted))
