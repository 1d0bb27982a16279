"""A node's networking half: the asyncio gRPC peer (`peer.py`) and the membership it keeps (`membership.py`).

Everything a caller needs is re-exported here: ``from dreamp2p.peer import Peer``.
"""

from dreamp2p.peer.peer import MAX_PENDING_ROUNDS, MAX_PROBE_BYTES, MAX_ROUNDS_AHEAD, RETRY_GROUP_BIT, Peer

__all__ = ["MAX_PENDING_ROUNDS", "MAX_PROBE_BYTES", "MAX_ROUNDS_AHEAD", "RETRY_GROUP_BIT", "Peer"]
