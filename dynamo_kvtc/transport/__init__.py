"""Moving bytes between processes and to files: the one control channel (msgpack with hard limits, ZMQ REP/REQ,
optional HMAC :class:`~dynamo_kvtc.transport.channel.Auth`), the hand-off's shared secret (:mod:`.auth`) and the one
place that waits on a NIXL transfer (:mod:`.nixl_io`: disk files through POSIX, READs between peers through UCX).

It sits below the tiers and the connector and knows nothing of blobs, stores or engines. ``channel`` and ``auth``
import without torch.
"""
