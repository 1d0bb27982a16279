"""A node's networking half: the asyncio gRPC peer (`peer.py`, a facade) over its parts (see its docstring).

Everything a caller needs is re-exported here: ``from dreamp2p.peer import Peer``.
"""

from dreamp2p.peer.peer import MAX_PROBE_BYTES, RETRY_GROUP_BIT, Peer
from dreamp2p.peer.rounds import MAX_PENDING_ROUNDS, MAX_ROUNDS_AHEAD

__all__ = ["MAX_PENDING_ROUNDS", "MAX_PROBE_BYTES", "MAX_ROUNDS_AHEAD", "RETRY_GROUP_BIT", "Peer"]
