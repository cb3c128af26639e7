{{/*
The standalone Envoy's bootstrap.  It is the structure epp/envoy_bootstrap.py renders (the demo and
the end-to-end tests run that one), with the EPP's headless Service as the ext_proc host:
tests/deploy/test_chart.py compares the two field by field, so change both together.
*/}}
{{- define "kv-epp.envoyConfig" -}}
{{- $e := .Values.envoy }}
{{- $host := printf "%s.%s.svc.%s" (include "kv-epp.extProcServiceName" .) .Release.Namespace $e.clusterDomain }}
{{- $port := int .Values.ports.grpc }}
admin:
  address:
    socket_address: {address: 127.0.0.1, port_value: {{ int $e.adminPort }}}
static_resources:
  listeners:
    - name: gateway
      address:
        socket_address: {address: 0.0.0.0, port_value: {{ int $e.listenPort }}}
      {{- if eq $e.requestBodyMode "BUFFERED" }}
      # In BUFFERED mode Envoy holds the whole body; past this limit it answers 413 itself.
      per_connection_buffer_limit_bytes: {{ int64 .Values.maxBodyBytes }}
      {{- end }}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: gateway
                # Streamed LLM responses can be quiet for long (a long prefill).
                stream_idle_timeout: {{ $e.routeTimeoutSeconds }}s
                request_timeout: 0s
                route_config:
                  name: epp
                  virtual_hosts:
                    - name: all
                      domains: ["*"]
                      routes:
                        - match: {prefix: /}
                          route:
                            cluster: original_destination_cluster
                            timeout: {{ $e.routeTimeoutSeconds }}s
                            idle_timeout: {{ $e.routeTimeoutSeconds }}s
                http_filters:
                  # Only the EPP chooses destinations: drop any a client sent.
                  - name: envoy.filters.http.header_mutation
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation
                      mutations:
                        request_mutations:
                          - remove: x-gateway-destination-endpoint
                          - remove: x-epp-original-dst-host
                  - name: envoy.filters.http.ext_proc
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
                      grpc_service:
                        envoy_grpc:
                          cluster_name: ext_proc
                          authority: {{ printf "%s:%d" $host $port }}
                        timeout: {{ $e.messageTimeoutSeconds }}s
                      failure_mode_allow: {{ $e.failureModeAllow }}
                      message_timeout: {{ $e.messageTimeoutSeconds }}s
                      processing_mode:
                        request_header_mode: SEND
                        request_body_mode: {{ $e.requestBodyMode }}
                        request_trailer_mode: SEND
                        response_header_mode: SEND
                        response_body_mode: FULL_DUPLEX_STREAMED
                        response_trailer_mode: SEND
                  # ORIGINAL_DST reads one ip:port; the EPP's header lists the primary then the
                  # fallbacks, so copy the primary into the header the cluster reads.
                  - name: envoy.filters.http.lua
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua
                      default_source_code:
                        inline_string: |
                          function envoy_on_request(handle)
                            local headers = handle:headers()
                            local targets = headers:get("x-gateway-destination-endpoint")
                            local primary = targets and string.match(targets, "^%s*([^,%s]+)")
                            if primary then
                              headers:replace("x-epp-original-dst-host", primary)
                            else
                              headers:remove("x-epp-original-dst-host")
                            end
                          end
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
                      suppress_envoy_headers: true
  clusters:
    - name: ext_proc
      # The EPP's headless Service: one endpoint per ready replica, re-resolved every 5 s.
      type: STRICT_DNS
      connect_timeout: {{ $e.connectTimeoutSeconds }}s
      lb_policy: ROUND_ROBIN
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config:
            http2_protocol_options: {}
      load_assignment:
        cluster_name: ext_proc
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address:
                    socket_address: {address: {{ $host }}, port_value: {{ $port }}}
      {{- if .Values.tls.enabled }}
      # The EPP serves ext_proc over TLS; like the Inference Extension's proxies, any
      # certificate is accepted (the EPP's is self-signed unless tls.secretName is set).
      transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
          common_tls_context:
            alpn_protocols: [h2]
      {{- end }}
      {{- with $e.extProcHealthCheckIntervalSeconds }}
      # Each replica answers grpc.health.v1 on the ext_proc port: NOT_SERVING while draining.
      health_checks:
        - timeout: {{ maxf 0.1 (minf 2.0 .) }}s
          interval: {{ . }}s
          # Envoy checks a cluster that never had traffic only every 60 s by default.
          no_traffic_interval: {{ . }}s
          no_traffic_healthy_interval: {{ . }}s
          unhealthy_threshold: 1
          healthy_threshold: 1
          reuse_connection: true
          grpc_health_check:
            service_name: envoy.service.ext_proc.v3.ExternalProcessor
      {{- end }}
    - name: original_destination_cluster
      type: ORIGINAL_DST
      connect_timeout: {{ $e.connectTimeoutSeconds }}s
      lb_policy: CLUSTER_PROVIDED
      # Close idle connections to a pod before vLLM does (its keep-alive is 5 s): a request
      # sent on a connection the server is closing fails with a 503.
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          common_http_protocol_options:
            idle_timeout: {{ $e.upstreamIdleTimeoutSeconds }}s
          explicit_http_config:
            http_protocol_options: {}
      # The EPP, not Envoy, limits concurrency.
      circuit_breakers:
        thresholds:
          - max_connections: 40000
            max_pending_requests: 40000
            max_requests: 40000
      original_dst_lb_config:
        use_http_header: true
        http_header_name: x-epp-original-dst-host
{{- end }}
