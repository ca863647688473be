"""The pool's RPC: msgpack messages with a raw payload over persistent TCP (or, same host,
unix) connections. `frame` (format, `Payload`), `spin` (polling policy), `server`, `client`;
socket helpers are `transfer.framing`, shared with the transfer engine."""

from kvpool.rpc.client import RpcClient
from kvpool.rpc.frame import Payload, parse_address
from kvpool.rpc.server import RpcServer, ServerConn

__all__ = ["Payload", "RpcClient", "RpcServer", "ServerConn", "parse_address"]
