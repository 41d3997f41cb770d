"""The cluster: several mountds acting as one cache, coordinated through Redis/Valkey.

Membership (heartbeat keys with a TTL: :mod:`mountd.cluster.membership`), placement of each
content hash on live members by rendezvous hashing (:mod:`mountd.cluster.placement`), the
authenticated peer transfer protocol (:mod:`mountd.cluster.wire`, :mod:`mountd.cluster.peer`),
the cluster-wide single-flight of bucket fetches (:mod:`mountd.cluster.flight`) and the
:class:`~mountd.cluster.service.Cluster` that ties them to the store's miss path
(:class:`mountd.store.peers.PeerSource`). See docs/cluster.md.

Layered between :mod:`mountd.coop` and :mod:`mountd.store`: may import the store, stats,
errors, digests and the base; the store never imports it (it is handed a ``PeerSource`` by
:mod:`mountd.daemon`).
"""
