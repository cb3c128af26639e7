"""The KV-cache view over gRPC (``protos/kvcache/api/kvcache.proto``): the service `epp serve`
runs on ``--kv-cache-grpc-port`` (`kvcache.api.service`), its generated stubs
(``kvcache_pb2*``, made by `kvcache.api.generate`) and the ``epp kv`` client
(`kvcache.api.client`)."""
