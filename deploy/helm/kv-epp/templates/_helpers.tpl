{{/* Names, labels and the values-derived settings shared by several templates. */}}

{{- define "kv-epp.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kv-epp.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kv-epp.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kv-epp.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kv-epp.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kv-epp.labels" -}}
helm.sh/chart: {{ include "kv-epp.chart" . }}
{{ include "kv-epp.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kv-epp.eppSelectorLabels" -}}
{{ include "kv-epp.selectorLabels" . }}
app.kubernetes.io/component: endpoint-picker
{{- end }}

{{- define "kv-epp.envoyFullname" -}}
{{- printf "%s-envoy" (include "kv-epp.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kv-epp.envoySelectorLabels" -}}
{{ include "kv-epp.selectorLabels" . }}
app.kubernetes.io/component: proxy
{{- end }}

{{/* Headless Service of the EPP replicas, for Envoy's STRICT_DNS ext_proc cluster. */}}
{{- define "kv-epp.extProcServiceName" -}}
{{- printf "%s-ext-proc" (include "kv-epp.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kv-epp.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kv-epp.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kv-epp.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "kv-epp.poolName" -}}
{{- default (include "kv-epp.fullname" .) .Values.inferencePool.name }}
{{- end }}

{{/* Checks of value combinations that would deploy something that cannot work. */}}
{{- define "kv-epp.validate" -}}
{{- if and (eq .Values.kvEvents.mode "central") (gt (int .Values.replicas) 1) }}
{{- fail "kvEvents.mode central works with replicas: 1 only (each vLLM pod publishes to a single EPP replica); use per-endpoint for active-active replicas" }}
{{- end }}
{{- if and .Values.inferencePool.create (ne .Values.inferencePool.group "inference.networking.k8s.io") }}
{{- fail (printf "inferencePool.create renders the inference.networking.k8s.io/v1 InferencePool; inferencePool.group is %q (create the older pool yourself, or use the v1 group)" .Values.inferencePool.group) }}
{{- end }}
{{- if and (hasPrefix "xxhash" .Values.vllm.hashAlgo) (kindIs "invalid" .Values.vllm.pythonHashSeed) }}
{{- fail (printf "vllm.hashAlgo %s needs vllm.pythonHashSeed: without PYTHONHASHSEED every vLLM process seeds xxhash randomly, so no EPP can reproduce its hashes" .Values.vllm.hashAlgo) }}
{{- end }}
{{- if and (not .Values.scheduling.configText) (not .Values.scheduling.plugins) }}
{{- fail "scheduling.plugins is empty: declare at least a scorer or a picker, or give scheduling.configText" }}
{{- end }}
{{- $ranks := len .Values.modelServers.targetPorts }}
{{- if and (gt $ranks 1) .Values.vllm.kvEventsReplayPort }}
{{- $gap := sub (int .Values.vllm.kvEventsReplayPort) (int .Values.vllm.kvEventsPort) }}
{{- if lt (ternary $gap (mul -1 $gap) (ge $gap 0)) $ranks }}
{{- fail (printf "vllm.kvEventsPort %d and vllm.kvEventsReplayPort %d clash for %d data-parallel ranks (modelServers.targetPorts): vLLM offsets both ports by the rank; put the replay port at least %d ports away (e.g. %d)" (int .Values.vllm.kvEventsPort) (int .Values.vllm.kvEventsReplayPort) $ranks $ranks (add (int .Values.vllm.kvEventsPort) 100)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The tokenizer directory given to the precise scorer ("" = none). */}}
{{- define "kv-epp.tokenizerPath" -}}
{{- $t := .Values.tokenizer }}
{{- if $t.path }}
{{- if or (hasPrefix "/" $t.path) (not $t.volume) }}{{ $t.path }}{{ else }}{{ printf "%s/%s" (trimSuffix "/" $t.mountPath) $t.path }}{{ end }}
{{- else if $t.volume }}
{{- $t.mountPath }}
{{- end }}
{{- end }}

{{/*
The parameters of a precise-prefix-cache-scorer: the plugin's own parameters plus everything that
must agree with the vLLM pods, taken from .Values.vllm, .Values.kvEvents and .Values.tokenizer.
Called with (list $ $plugin); returns YAML.
*/}}
{{- define "kv-epp.preciseParameters" -}}
{{- $root := index . 0 }}
{{- $plugin := index . 1 }}
{{- $v := $root.Values.vllm }}
{{- $params := deepCopy (default (dict) $plugin.parameters) }}
{{- range $key := list "blockSize" "hashAlgo" "hashSeed" "tokenizer" "tokenizers" }}
{{- if hasKey $params $key }}
{{- fail (printf "scheduling.plugins %s: parameters.%s is set from the chart's values (vllm.*, tokenizer.*) so that the EPP and the pods agree; remove it there" (default $plugin.type $plugin.name) $key) }}
{{- end }}
{{- end }}
{{- if $v.blockSize }}
{{- $_ := set $params "blockSize" (int $v.blockSize) }}
{{- end }}
{{- $_ := set $params "hashAlgo" $v.hashAlgo }}
{{- if not (kindIs "invalid" $v.pythonHashSeed) }}
{{- $_ := set $params "hashSeed" (toString $v.pythonHashSeed) }}
{{- end }}
{{- $tokenizer := include "kv-epp.tokenizerPath" $root }}
{{- if $tokenizer }}
{{- $_ := set $params "tokenizer" $tokenizer }}
{{- end }}
{{- if $root.Values.tokenizer.models }}
{{- $models := dict }}
{{- range $model, $dir := $root.Values.tokenizer.models }}
{{- $_ := set $models $model (ternary $dir (printf "%s/%s" (trimSuffix "/" $root.Values.tokenizer.mountPath) $dir) (hasPrefix "/" $dir)) }}
{{- end }}
{{- $_ := set $params "tokenizers" $models }}
{{- end }}
{{- $events := deepCopy (default (dict) $params.kvEvents) }}
{{- $_ := set $events "mode" $root.Values.kvEvents.mode }}
{{- if eq $root.Values.kvEvents.mode "central" }}
{{- $_ := set $events "bindAddress" (printf "tcp://*:%d" (int $v.kvEventsPort)) }}
{{- end }}
{{- $_ := set $params "kvEvents" $events }}
{{- $store := include "kv-epp.kvStoreAddress" $root }}
{{- if $store }}
{{- $namespace := default (include "kv-epp.fullname" $root) $root.Values.kvStore.namespace }}
{{- $_ := set $params "kvBlockIndexConfig" (dict "redisConfig" (dict "address" $store "namespace" $namespace)) }}
{{- end }}
{{- toYaml $params }}
{{- end }}

{{/*
The EndpointPickerConfig YAML: scheduling.configText verbatim, or scheduling.plugins declared in
order and put into one profile, each with its weight (scheduling.weights.<name>, else the
plugin's own `weight`, else the EPP's default of 1).
*/}}
{{- define "kv-epp.config" -}}
{{- if .Values.scheduling.configText }}
{{- .Values.scheduling.configText }}
{{- else }}
{{- $root := . }}
{{- $names := dict }}
{{- range $i, $p := .Values.scheduling.plugins }}
{{- if not $p.type }}
{{- fail (printf "scheduling.plugins[%d]: `type` is required" $i) }}
{{- end }}
{{- $_ := set $names (default $p.type $p.name) true }}
{{- end }}
{{- range $name, $weight := .Values.scheduling.weights }}
{{- if not (hasKey $names $name) }}
{{- fail (printf "scheduling.weights.%s: no plugin named %q in scheduling.plugins (declared: %s)" $name $name (keys $names | sortAlpha | join ", ")) }}
{{- end }}
{{- end -}}
# Rendered by the kv-epp chart from its values (scheduling.*, vllm.*, kvEvents.*, tokenizer.*).
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
{{- range .Values.scheduling.plugins }}
- name: {{ default .type .name }}
  type: {{ .type }}
  {{- if eq .type "precise-prefix-cache-scorer" }}
  parameters:
    {{- include "kv-epp.preciseParameters" (list $root .) | nindent 4 }}
  {{- else if .parameters }}
  parameters:
    {{- toYaml .parameters | nindent 4 }}
  {{- end }}
{{- end }}
schedulingProfiles:
- name: {{ .Values.scheduling.profileName }}
  plugins:
  {{- range .Values.scheduling.plugins }}
  {{- if or (not (hasKey . "inProfile")) .inProfile }}
  {{- $name := default .type .name }}
  - pluginRef: {{ $name }}
    {{- if hasKey $root.Values.scheduling.weights $name }}
    weight: {{ index $root.Values.scheduling.weights $name }}
    {{- else if hasKey . "weight" }}
    weight: {{ .weight }}
    {{- end }}
  {{- end }}
  {{- end }}
{{- end }}
{{- end }}

{{/* Whether the precise scorer is in use, so the pods must publish KV events. */}}
{{- define "kv-epp.usesKVEvents" -}}
{{- if .Values.scheduling.configText }}
{{- if contains "precise-prefix-cache-scorer" .Values.scheduling.configText }}true{{ end }}
{{- else }}
{{- range .Values.scheduling.plugins }}{{ if eq .type "precise-prefix-cache-scorer" }}true{{ end }}{{ end }}
{{- end }}
{{- end }}

{{/*
vLLM's --kv-events-config JSON for the pods, keys in the order of vLLM's KVEventsConfig.  POD_IP
comes from the downward API; the topic is informational (the EPP keys events by socket).
*/}}
{{- define "kv-epp.kvEventsConfig" -}}
{{- $v := .Values.vllm }}
{{- $endpoint := printf "tcp://*:%d" (int $v.kvEventsPort) }}
{{- if eq .Values.kvEvents.mode "central" }}
{{- $endpoint = printf "tcp://%s.%s.svc:%d" (include "kv-epp.fullname" .) .Release.Namespace (int $v.kvEventsPort) }}
{{- end }}
{{- $model := default "SERVED_MODEL_NAME" .Values.modelServers.modelName }}
{{- $topic := printf "kv@$(POD_IP):%d@%s" (int (first .Values.modelServers.targetPorts)) $model }}
{{- $replay := "" }}
{{- if $v.kvEventsReplayPort }}
{{- $replay = printf ",\"replay_endpoint\":%s" (printf "tcp://*:%d" (int $v.kvEventsReplayPort) | toJson) }}
{{- end }}
{{- printf "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":%s%s,\"topic\":%s}" (toJson $endpoint) $replay (toJson $topic) }}
{{- end }}

{{/* `epp serve` arguments. */}}
{{- define "kv-epp.args" -}}
{{- $v := .Values.vllm }}
- --log-level={{ .Values.logLevel }}
- serve
- --pool-name={{ include "kv-epp.poolName" . }}
- --pool-namespace={{ .Release.Namespace }}
- --pool-group={{ .Values.inferencePool.group }}
- --config-file=/config/epp-config.yaml
- --grpc-port={{ .Values.ports.grpc }}
- --grpc-health-port={{ .Values.ports.grpcHealth }}
- --metrics-port={{ .Values.ports.metrics }}
{{- if .Values.ports.kvCacheApi }}
- --kv-cache-grpc-port={{ .Values.ports.kvCacheApi }}
{{- end }}
{{- if include "kv-epp.usesKVEvents" . }}
- --kv-events-port={{ $v.kvEventsPort }}
{{- if $v.kvEventsReplayPort }}
- --kv-events-replay-port={{ $v.kvEventsReplayPort }}
{{- end }}
{{- else }}
- --kv-events-port=off
{{- end }}
{{- if .Values.tls.enabled }}
- --secure-serving=true
{{- if .Values.tls.secretName }}
- --cert-path=/etc/epp/tls
- --enable-cert-reload=true
{{- end }}
{{- end }}
{{- with .Values.admission }}
{{- if .maxInFlightPerEndpoint }}
- --max-in-flight-per-endpoint={{ int64 .maxInFlightPerEndpoint }}
- --admission-mode={{ .mode }}
{{- if eq .mode "queue" }}
- --max-queued-requests={{ int64 .maxQueuedRequests }}
- --max-queue-wait={{ .maxQueueWaitSeconds }}s
{{- end }}
{{- end }}
{{- end }}
- --drain-timeout={{ .Values.drainTimeoutSeconds }}s
- --max-body-bytes={{ int64 .Values.maxBodyBytes }}
{{- range $key, $value := .Values.flags }}
- --{{ $key }}={{ $value }}
{{- end }}
{{- range .Values.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/*
The shared KV-block index's address: kvStore.address, or the bundled Valkey's Service; empty for
the in-memory index.
*/}}
{{- define "kv-epp.kvStoreAddress" -}}
{{- if and .Values.kvStore.address .Values.kvStore.valkey.enabled }}
{{- fail "kvStore: set address (your own server) or valkey.enabled (the chart's), not both" }}
{{- end }}
{{- if .Values.kvStore.valkey.enabled }}
{{- printf "redis://%s-valkey.%s.svc:6379" (include "kv-epp.fullname" .) .Release.Namespace }}
{{- else }}
{{- .Values.kvStore.address }}
{{- end }}
{{- end }}
