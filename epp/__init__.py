"""The endpoint picker's server: everything between Envoy and the scheduling plugins.

`epp serve` (`epp.cli`) builds an `epp.server.EndpointPicker`: the ext_proc server (`epp.extproc`)
parses each request (`epp.requests`) and the `epp.director.Director` runs the scheduler that
`epp.config` builds from the plugins over the endpoints in `epp.datastore`, which discovery
(`epp.discovery`) and metrics scraping (`epp.scraping`) keep current.  Map: docs/architecture.md.
"""
