"""The KV-cache view: which pod holds which prompt blocks, kept from the pods' KV events.

`kvcache.views.KVCacheViews` owns the views (built from `kvcache.settings.KVCacheSettings`,
started and fed endpoints by the server); `kvcache.view.KVCacheView` is what readers use: block
keys of a prompt and what each endpoint holds of them.  The machinery under it (vLLM-exact
tokenization and hashing, event decoding, the index, the subscribers) is in `indexer`.
"""
