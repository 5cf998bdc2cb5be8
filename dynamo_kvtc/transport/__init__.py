"""Moving bytes between processes and to files: the one control channel (msgpack with hard limits, ZMQ REP/REQ,
optional HMAC :class:`~dynamo_kvtc.transport.channel.Auth`), the hand-off's shared secret (:mod:`.auth`) and the one
place that waits on a NIXL transfer (:mod:`.nixl_io`: disk files through POSIX, READs between peers through UCX), the
hand-off's NIXL-registered memory (:mod:`.staging`: the prefill side's staging arena, the decode side's receive
buffer) and the blob whose bytes are still landing in it (:mod:`.arriving`: an arriving
:class:`~dynamo_kvtc.codec.blob.BlobView`).

It sits above the codec (it may import ``codec.blob``) and below the tiers and the connector, and knows nothing of
stores or engines. ``channel`` and ``auth`` import without torch.
"""
