"""Admission: which members' handshakes this peer accepted, and the refusals it remembers.

A handshake (`Hello`) is accepted only from a member of our ring, in our cluster, speaking our protocol
version, holding the same model manifest, able to decode our codec and, once both sides declared them,
with the same training settings. A member refused for its model or settings is remembered, so our own
handshake towards it fails at once with the same words instead of retrying until a timeout.
Our own hello, which every handshake and admission answer carries, is built here too (`hello_of`, with
the address members reach us at, `address_of`).
Runs on the peer's event loop only.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from dreamp2p.compression import codec_names, get_codec
from dreamp2p.config import PeerConfig
from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import PROTOCOL_VERSION, Hello
from dreamp2p.settings import settings_mismatch

log = logging.getLogger(__name__)


def address_of(config: PeerConfig, port: int) -> str:
    """Where members reach this node: the advertised address, else the listen host at the bound ``port``."""
    if config.advertise:
        return config.advertise
    host = config.listen.rsplit(":", 1)[0]
    return f"{host}:{port}"


def hello_of(config: PeerConfig, address: str, settings: tuple[tuple[str, str], ...]) -> Hello:
    """This node's hello: its cluster, protocol, model manifest, every codec it decodes and its settings."""
    return Hello(
        cluster_id=config.cluster_id,
        protocol_version=PROTOCOL_VERSION,
        node_id=config.node_id,
        manifest_hash=config.manifest_hash,
        codecs=tuple(get_codec(n).wire_id for n in codec_names()),
        advertise_address=address,
        settings=settings,
    )


def refusal(theirs: Hello, mine: Hello, members: Collection[str], codec_wire_id: int, codec: str) -> PeerError | None:
    """Why the handshake ``theirs`` must be refused by a peer whose own hello is ``mine`` (None: accept)."""
    if theirs.cluster_id != mine.cluster_id:
        return PeerError(Status.CLUSTER_MISMATCH, f"cluster {theirs.cluster_id!r}, this peer is in {mine.cluster_id!r}")
    if theirs.protocol_version != PROTOCOL_VERSION:
        return PeerError(
            Status.VERSION_MISMATCH,
            f"protocol version {theirs.protocol_version}, this peer speaks {PROTOCOL_VERSION}",
        )
    if theirs.manifest_hash != mine.manifest_hash:
        return PeerError(
            Status.MANIFEST_MISMATCH,
            f"{theirs.node_id}'s model manifest {theirs.manifest_hash.hex()[:16]} differs from "
            f"{mine.node_id}'s {mine.manifest_hash.hex()[:16]} (names, shapes or dtypes of the model state)",
        )
    if members and theirs.node_id not in members:
        return PeerError(Status.UNKNOWN_PEER, f"node {theirs.node_id!r} is not a member of this ring")
    if codec_wire_id not in theirs.codecs:
        return PeerError(Status.UNKNOWN_CODEC, f"peer cannot decode codec {codec}")
    differ = settings_mismatch(dict(mine.settings), dict(theirs.settings), mine.node_id, theirs.node_id)
    if differ is not None:
        return PeerError(Status.CONFIG_MISMATCH, differ)
    return None


# refusals that mean "this member and we cannot train together", remembered for our own handshakes
_LASTING = (Status.MANIFEST_MISMATCH, Status.CONFIG_MISMATCH)


class Admission:
    def __init__(self) -> None:
        self._admitted: dict[str, Hello] = {}
        self._conflicts: dict[str, PeerError] = {}

    def admit(self, theirs: Hello, mine: Hello, members: Collection[str], codec_wire_id: int, codec: str) -> None:
        """Accept ``theirs`` or raise PeerError saying why not (see :func:`refusal`)."""
        err = refusal(theirs, mine, members, codec_wire_id, codec)
        if err is not None:
            if err.status in _LASTING:
                log.error("refusing %s: %s", theirs.node_id, err.detail)
                self._conflicts[theirs.node_id] = err
            raise err
        self._conflicts.pop(theirs.node_id, None)  # it came back with a matching model and settings
        self._admitted[theirs.node_id] = theirs

    def is_admitted(self, node: str) -> bool:
        return node in self._admitted

    def conflict_with(self, node: str) -> PeerError | None:
        """The lasting refusal we gave ``node``, if any."""
        return self._conflicts.get(node)

    def admitted(self) -> dict[str, Hello]:
        """A copy: every member whose handshake this process accepted, with its hello."""
        return dict(self._admitted)
