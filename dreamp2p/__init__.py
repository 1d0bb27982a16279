"""dreamp2p: train one PyTorch model across regions joined by slow internet links.

Public surface: :class:`Node` (``node.attach(model, optimizer)``), :class:`~dreamp2p.peer.Peer` (the asyncio
gRPC peer with ring averaging) and the configuration types.
"""

from dreamp2p.config import PeerConfig, PeerInfo, TLSConfig, TransportConfig
from dreamp2p.errors import FlushIncomplete, PeerError, RoundFailed, Status
from dreamp2p.messages import PROTOCOL_VERSION

__all__ = [
    "PROTOCOL_VERSION",
    "FlushIncomplete",
    "Node",
    "PeerConfig",
    "PeerError",
    "PeerInfo",
    "RoundFailed",
    "Status",
    "TLSConfig",
    "TransportConfig",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # Node pulls in the torch side; imported lazily so `import dreamp2p` stays light and acyclic
    if name == "Node":
        from dreamp2p.node import Node

        return Node
    raise AttributeError(f"module 'dreamp2p' has no attribute {name!r}")
