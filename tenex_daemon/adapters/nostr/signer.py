"""Signing keys: one :class:`Signer` per agent plus the project key.

Keys are read from files that only their owner may read (mode 0600 or stricter), in a folder
only their owner may enter (0700 or stricter), written as 64 hex characters or as an ``nsec``.
A secret never appears in a log line, a ``repr`` or an exception message: errors name the file
and what is wrong with it, never its content.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import structlog
from coincurve import PrivateKey, PublicKeyXOnly
from coincurve._libsecp256k1 import ffi, lib  # the keypair API coincurve's sign_schnorr rebuilds per call

from tenex_daemon.core import nip19
from tenex_daemon.core.errors import TenexError
from tenex_daemon.core.events import NostrEvent
from tenex_daemon.core.vocabulary import KIND_RELAY_AUTH

from .codec import auth_event_template, event_id_digest

log = structlog.get_logger(__name__)

_GROUP_OTHER_BITS = stat.S_IRWXG | stat.S_IRWXO


class KeyFileError(TenexError):
    """A key file is missing, too open, or does not hold a key. The message never holds the key."""


class Signer:
    """Signs events with one secp256k1 key (BIP-340 Schnorr, fresh random aux bytes per signature).

    The secret is held only inside a coincurve ``PrivateKey`` and the libsecp256k1 keypair made from
    it once (coincurve's ``sign_schnorr`` makes that keypair again for every signature, a third of
    its cost); every signature is verified before it is returned, as coincurve does (BIP-340's
    defence against a fault that would leak the key). ``repr`` shows the public key.
    """

    __slots__ = ("_key", "_keypair", "_pubkey", "_xonly", "label")

    def __init__(self, secret: bytes, *, label: str = "") -> None:
        """Make a signer from 32 secret bytes; ``label`` (an agent slug...) is for logs."""
        if len(secret) != 32:
            raise KeyFileError("a secret key must be 32 bytes")
        try:
            self._key = PrivateKey(secret)
        except ValueError:
            raise KeyFileError("the secret key is not a valid secp256k1 scalar") from None
        self._xonly = PublicKeyXOnly.from_secret(secret)
        self._pubkey = self._xonly.format().hex()
        self._keypair = ffi.new("secp256k1_keypair *")
        if not lib.secp256k1_keypair_create(self._key.context.ctx, self._keypair, secret):
            raise KeyFileError("the secret key is not a valid secp256k1 scalar")
        self.label = label

    @classmethod
    def from_text(cls, text: str, *, label: str = "") -> Signer:
        """Make a signer from 64 hex characters or an ``nsec`` string."""
        value = text.strip()
        if value.startswith("nsec1"):
            try:
                entity = nip19.decode(value)
            except nip19.Nip19Error:
                raise KeyFileError("the nsec is not valid bech32") from None
            return cls(bytes.fromhex(entity.value), label=label)
        if len(value) == 64:
            try:
                return cls(bytes.fromhex(value), label=label)
            except ValueError:
                pass
        raise KeyFileError("a key must be 64 hex characters or an nsec")

    @classmethod
    def generate(cls, *, label: str = "") -> Signer:
        """Make a signer with a fresh random key."""
        return cls(PrivateKey().secret, label=label)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, label: str = "") -> Signer:
        """Load a key file (hex or nsec). Refuse files that group or others may access, and files in a
        folder that group or others may access (they could list, replace or watch the keys there).

        Raises :class:`KeyFileError` naming the file (or folder) and its mode.
        """
        file = Path(path)
        try:
            info = file.stat()
        except FileNotFoundError:
            raise KeyFileError(f"key file {file} does not exist") from None
        if not stat.S_ISREG(info.st_mode):
            raise KeyFileError(f"key file {file} is not a regular file")
        mode = stat.S_IMODE(info.st_mode)
        if mode & _GROUP_OTHER_BITS:
            raise KeyFileError(
                f"key file {file} has mode {mode:04o}; it must be 0600 or stricter "
                f"(run: chmod 600 {file})"
            )
        folder = file.absolute().parent
        folder_mode = stat.S_IMODE(folder.stat().st_mode)
        if folder_mode & _GROUP_OTHER_BITS:
            raise KeyFileError(
                f"key folder {folder} has mode {folder_mode:04o}; it must be 0700 or stricter "
                f"(run: chmod 700 {folder})"
            )
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KeyFileError(f"key file {file} cannot be read ({type(exc).__name__})") from None
        try:
            signer = cls.from_text(text, label=label or file.stem)
        except KeyFileError as exc:
            raise KeyFileError(f"key file {file}: {exc}") from None
        log.debug("key loaded", file=str(file), pubkey=signer.pubkey, label=signer.label)
        return signer

    @property
    def pubkey(self) -> str:
        """The x-only public key in hex."""
        return self._pubkey

    @property
    def npub(self) -> str:
        """The public key as npub."""
        return nip19.encode_npub(self._pubkey)

    def secret_hex(self) -> str:
        """Return the secret in hex, for writing a key file (never log the result)."""
        secret: bytes = self._key.secret
        return secret.hex()

    def now(self) -> int:
        """The time an event signed now is dated (Unix seconds)."""
        return int(time.time())

    def sign(
        self,
        kind: int,
        content: str,
        tags: Iterable[Iterable[str]] = (),
        *,
        created_at: int | None = None,
    ) -> NostrEvent:
        """Return a complete, signed event authored by this key."""
        tag_list = [list(tag) for tag in tags]
        ts = self.now() if created_at is None else created_at
        digest = event_id_digest(self._pubkey, ts, kind, tag_list, content)
        return NostrEvent(
            id=digest.hex(), pubkey=self._pubkey, created_at=ts, kind=kind, tags=tag_list,
            content=content, sig=self._schnorr(digest).hex(),
        )

    def _schnorr(self, digest: bytes) -> bytes:
        """The BIP-340 signature of a 32-byte digest with the kept keypair, verified before it is returned."""
        context = self._key.context.ctx
        signature = ffi.new("unsigned char[64]")
        if not lib.secp256k1_schnorrsig_sign32(context, signature, digest, self._keypair, os.urandom(32)):
            raise ValueError("signing failed")
        if not lib.secp256k1_schnorrsig_verify(context, signature, digest, 32, self._xonly.public_key):
            raise ValueError("the signature made does not verify")
        return bytes(ffi.buffer(signature, 64))

    def sign_auth(self, relay_url: str, challenge: str) -> NostrEvent:
        """Return the NIP-42 event (kind 22242) answering a relay's challenge."""
        kind, tags, content = auth_event_template(relay_url, challenge)
        assert kind == KIND_RELAY_AUTH
        return self.sign(kind, content, tags)

    def __repr__(self) -> str:
        label = f" {self.label!r}" if self.label else ""
        return f"<Signer{label} pubkey={self._pubkey}>"

    __str__ = __repr__

    def __reduce__(self) -> str | tuple[object, ...]:
        """Refuse pickling: a pickle would carry the secret to wherever it is written."""
        raise TypeError("a Signer cannot be pickled")


class Keyring(Mapping[str, Signer]):
    """The signers of a project, by public key (agents plus the project key)."""

    def __init__(self, signers: Iterable[Signer] = ()) -> None:
        """Hold these signers."""
        self._by_pubkey: dict[str, Signer] = {}
        for signer in signers:
            self.add(signer)

    def add(self, signer: Signer) -> None:
        """Add a signer (a second one with the same key replaces the first)."""
        self._by_pubkey[signer.pubkey] = signer

    @classmethod
    def from_files(cls, paths: Mapping[str, str | os.PathLike[str]]) -> Keyring:
        """Load one key file per label (``{"project": path, "planner": path}``)."""
        return cls(Signer.from_file(path, label=label) for label, path in paths.items())

    def by_label(self, label: str) -> Signer | None:
        """Return the signer with this label, if any."""
        return next((s for s in self._by_pubkey.values() if s.label == label), None)

    def __getitem__(self, pubkey: str) -> Signer:
        return self._by_pubkey[pubkey]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_pubkey)

    def __len__(self) -> int:
        return len(self._by_pubkey)

    def __repr__(self) -> str:
        return f"<Keyring {len(self)} keys: {', '.join(s.label or s.pubkey[:8] for s in self.values())}>"


def write_key_file(path: str | os.PathLike[str], signer: Signer) -> None:
    """Write the signer's secret as hex to a new file created with mode 0600 (never wider)."""
    file = Path(path)
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(signer.secret_hex() + "\n")
        handle.flush()
        os.fsync(handle.fileno())
