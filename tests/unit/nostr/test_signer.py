"""Signers: key files with strict modes, signing that verifies, and secrets that never leak."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import pytest
import structlog
from coincurve import PublicKeyXOnly
from structlog.testing import capture_logs

from tenex_daemon.adapters.nostr.codec import verify_event
from tenex_daemon.adapters.nostr.signer import KeyFileError, Keyring, Signer, write_key_file
from tenex_daemon.core import nip19
from tenex_daemon.testing import KeyPair

KEYS = KeyPair.from_seed(501)


def key_file(tmp_path: Path, text: str, mode: int = 0o600, name: str = "agent.key") -> Path:
    """Write a key file with the given mode."""
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return path


def test_signed_events_verify_and_carry_the_pubkey() -> None:
    """A signer's events have its pubkey, a matching id and a valid signature; signatures are randomised."""
    signer = Signer.from_text(KEYS.secret)
    assert signer.pubkey == KEYS.pubkey
    first = signer.sign(1111, "hello ✨", [["p", KEYS.pubkey]], created_at=1_700_000_000)
    second = signer.sign(1111, "hello ✨", [["p", KEYS.pubkey]], created_at=1_700_000_000)
    assert first.pubkey == KEYS.pubkey
    assert verify_event(first)
    assert verify_event(second)
    assert first.id == second.id


def test_the_kept_keypair_signs_every_event_with_its_own_key_and_fresh_randomness() -> None:
    """Signers that keep their keypair across calls, interleaved, each sign only with their own key
    (coincurve's own verifier accepts every signature for its pubkey and refuses it for the other's),
    and no two signatures of the same event are equal (fresh auxiliary bytes each time)."""
    first, second = Signer.from_text(KEYS.secret), Signer.generate()
    signatures: dict[str, set[str]] = {first.pubkey: set(), second.pubkey: set()}
    for n in range(50):
        for signer, other in ((first, second), (second, first)):
            event = signer.sign(1, "same", [], created_at=1_700_000_000)
            digest, sig = bytes.fromhex(event.id), bytes.fromhex(event.sig)
            assert PublicKeyXOnly(bytes.fromhex(signer.pubkey)).verify(sig, digest), n
            assert not PublicKeyXOnly(bytes.fromhex(other.pubkey)).verify(sig, digest), n
            signatures[signer.pubkey].add(event.sig)
    assert [len(each) for each in signatures.values()] == [50, 50]


def test_auth_event_answers_the_challenge() -> None:
    """The NIP-42 event is kind 22242 with the relay and challenge tags, and verifies."""
    event = Signer.from_text(KEYS.secret).sign_auth("wss://relay.example", "c-1")
    assert event.kind == 22242
    assert event.tags == [["relay", "wss://relay.example"], ["challenge", "c-1"]]
    assert verify_event(event)


def test_key_files_in_hex_and_nsec_load(tmp_path: Path) -> None:
    """Files holding 64 hex characters or an nsec (with a trailing newline) load as the same key."""
    hex_file = key_file(tmp_path, KEYS.secret + "\n", name="hex.key")
    nsec_file = key_file(tmp_path, nip19.encode_nsec(KEYS.secret) + "\n", name="nsec.key")
    assert Signer.from_file(hex_file).pubkey == KEYS.pubkey
    assert Signer.from_file(nsec_file).pubkey == KEYS.pubkey
    assert Signer.from_file(hex_file).label == "hex"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o666, 0o700 | 0o040])
def test_loose_modes_are_refused_naming_file_and_mode(tmp_path: Path, mode: int) -> None:
    """A key file readable or writable by group or others is refused; the error names file and mode."""
    path = key_file(tmp_path, KEYS.secret, mode)
    with pytest.raises(KeyFileError) as caught:
        Signer.from_file(path)
    message = str(caught.value)
    assert str(path) in message
    assert f"{mode:04o}" in message
    assert KEYS.secret not in message


def test_strict_modes_are_accepted(tmp_path: Path) -> None:
    """Mode 0600 and 0400 are fine."""
    assert Signer.from_file(key_file(tmp_path, KEYS.secret, 0o400)).pubkey == KEYS.pubkey


@pytest.mark.parametrize(
    "text",
    [
        "zz" * 32,
        "ab" * 31,
        "nsec1notvalid",
        nip19.encode_npub("cd" * 32),
        "00" * 32,
    ],
)
def test_bad_key_content_is_refused_without_echoing_it(tmp_path: Path, text: str) -> None:
    """Invalid key text is refused with the file named and the text itself never in the message."""
    path = key_file(tmp_path, text)
    with pytest.raises(KeyFileError) as caught:
        Signer.from_file(path)
    message = str(caught.value)
    assert str(path) in message
    assert text not in message
    assert caught.value.__cause__ is None
    assert caught.value.__suppress_context__


def test_missing_file_is_named(tmp_path: Path) -> None:
    """A missing key file is reported by path."""
    with pytest.raises(KeyFileError, match="does not exist"):
        Signer.from_file(tmp_path / "nope.key")


def test_secret_never_appears_in_repr_logs_or_pickles(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """repr, str, log lines (structlog and stdlib) and a refused pickle never show the secret or nsec."""
    nsec = nip19.encode_nsec(KEYS.secret)
    path = key_file(tmp_path, nsec)
    caplog.set_level(logging.DEBUG)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with capture_logs() as logs:
            signer = Signer.from_file(path, label="planner")
            keyring = Keyring([signer])
            signer.sign(1, "x")
    finally:
        structlog.reset_defaults()
    texts = [repr(signer), str(signer), repr(keyring), str(logs), caplog.text]
    with pytest.raises(TypeError) as caught:
        pickle.dumps(signer)
    texts.append(str(caught.value))
    assert logs  # the load was logged
    for text in texts:
        assert KEYS.secret not in text
        assert nsec not in text
        assert KEYS.secret.upper() not in text
    assert KEYS.pubkey in repr(signer)


def test_keyring_and_key_file_writing(tmp_path: Path) -> None:
    """write_key_file creates a 0600 file that loads back; the keyring finds signers by pubkey and label."""
    signer = Signer.generate(label="project")
    path = tmp_path / "project.key"
    write_key_file(path, signer)
    assert path.stat().st_mode & 0o777 == 0o600
    keyring = Keyring.from_files({"project": path})
    assert keyring[signer.pubkey].pubkey == signer.pubkey
    by_label = keyring.by_label("project")
    assert by_label is not None
    assert by_label.pubkey == signer.pubkey
    assert len(keyring) == 1
    with pytest.raises(FileExistsError):
        write_key_file(path, signer)
