"""dreamp2p: train one PyTorch model across regions joined by slow internet links.

Public surface: :class:`Peer` (asyncio gRPC peer with ring averaging) and the configuration types.
"""

from dreamp2p.config import PeerConfig, PeerInfo, TLSConfig, TransportConfig
from dreamp2p.errors import PeerError, RoundFailed, Status

__all__ = [
    "PROTOCOL_VERSION",
    "PeerConfig",
    "PeerError",
    "PeerInfo",
    "RoundFailed",
    "Status",
    "TLSConfig",
    "TransportConfig",
]

PROTOCOL_VERSION = 1
__version__ = "0.1.0"
