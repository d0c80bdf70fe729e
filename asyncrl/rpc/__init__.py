"""Calls to Ray actors over ZeroMQ: Ray places the actor and watches it, the calls skip Ray.

A Ray actor call costs its caller about 0.6 ms of CPU, and a streaming call more per message
(`docs/scale.md`): at 128 engine replicas the Rollouter's group calls and the weight sync's
3 x 128 pause / update / resume calls filled a core with Ray's own work. Here a call is a
msgpack record over a DEALER -> ROUTER pair of ZeroMQ sockets, answered in the actor's own event
loop (about a tenth of a Ray call's CPU to the caller when calls overlap).

One module per concern:

- `asyncrl.rpc.server`, **serving**: an actor class mixes in `Serving`. Its ``serve_rpc`` (called
  through Ray) makes an `RpcServer` in the actor's event loop: on loopback for a caller of the
  actor's node; for a caller of another node, a CURVE server on the node's address. A call's
  ``key`` names the object its method runs on (None: the actor itself; an index: one of a
  benchmark host's replicas). An ``async`` method runs as a task of the actor's loop, so calls
  run concurrently as Ray runs them; a plain one inline.
- `asyncrl.rpc.client`, **calling**: `link` asks a Ray handle for its endpoint and returns an
  `RpcActor`, a stand-in for the handle, sending on its caller's `Links` (one socket and liveness
  watch per event loop and actor; each caller owns one, the module keeps none): ``actor.method.remote(*args)`` sends at
  once and returns a future; ``actor.method.options(num_returns="streaming")`` (as Ray's) and
  `calls.stream` give an async generator's items as they come. Anything else (an in-process
  engine, a test's stand-in for a handle) is returned as it is. An `RpcActor` pickles as its
  handle and endpoint, for another process of the same node; on another node it refuses to link.
- `asyncrl.rpc.wire`, **messages**: typed msgpack records (call, reply; values: msgpack's own,
  tuples, sets, numpy arrays, dataclasses, exceptions with their remote traceback); no pickle.
- `asyncrl.rpc.auth`, **admission**: one key per run, given to every process of the run
  through Ray (``ASYNCRL_RUN_KEY``); every message either way carries a keyed BLAKE2b MAC
  under it, checked before anything is decoded. A message without a valid MAC is dropped
  unanswered and counted (``RpcServer.rejected``, ``_Link.rejected``): a local process outside
  the run, or a server or caller of another run, gets nothing run or accepted
  (`docs/security.md`). CURVE admits a caller of another node.
- `asyncrl.rpc.liveness`: each link keeps one Ray call to its actor open (``rpc_watch``); when
  the actor dies, every call in flight and every later one fails with Ray's own error.
- `asyncrl.pump`: the socket pump the calls share with the sample stream.

Order and loss: one TCP connection per link, so calls start in the order sent (as Ray's from
one caller do); high-water marks are off, so nothing is dropped.

Left out: cancelling a call does not stop it in the actor (as with Ray); a caller whose CURVE
handshake fails (a key never registered) waits, as a call to a hung actor does, for its deadline.
"""

from asyncrl.rpc.auth import node_ip, run_env, run_key
from asyncrl.rpc.client import Links, OtherRunError, RpcActor, link, link_each
from asyncrl.rpc.liveness import WATCH_S
from asyncrl.rpc.server import RpcServer, Serving
from asyncrl.rpc.wire import RemoteError, RemoteTraceback, WireError

__all__ = ["WATCH_S", "Links", "OtherRunError", "RemoteError", "RemoteTraceback", "RpcActor", "RpcServer", "Serving",
           "WireError", "link", "link_each", "node_ip", "run_env", "run_key"]
