{{/* Names, labels and the pieces every workload shares. */}}

{{- define "spindle.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "spindle.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The name of one component's objects: fullname-COMPONENT. Call with (list $ "gateway"). */}}
{{- define "spindle.component" -}}
{{- printf "%s-%s" (include "spindle.fullname" (index . 0)) (index . 1) -}}
{{- end -}}

{{- define "spindle.selectorLabels" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: {{ include "spindle.name" $ }}
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "spindle.labels" -}}
{{- $ := index . 0 -}}
{{ include "spindle.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" $.Chart.Name $.Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ $.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $.Release.Service }}
app.kubernetes.io/part-of: spindle
{{- end -}}

{{/* repository:tag of an image block; call with (list $ .Values.gateway.image "suffix"). */}}
{{- define "spindle.image" -}}
{{- $ := index . 0 -}}{{- $img := index . 1 -}}{{- $suffix := index . 2 -}}
{{- $tag := default $.Chart.AppVersion $img.tag -}}
{{- if $suffix -}}{{- $tag = printf "%s-%s" $tag $suffix -}}{{- end -}}
{{- printf "%s:%s" $img.repository $tag -}}
{{- end -}}

{{/* A value as an env string: whole numbers without an exponent (Helm reads numbers as floats). */}}
{{- define "spindle.str" -}}
{{- if and (kindIs "float64" .) (eq (floor .) .) -}}{{- int64 . -}}{{- else -}}{{- toString . -}}{{- end -}}
{{- end -}}

{{/* Env entries for a map of flags: `max-num-seqs: 8` becomes SPINDLE_MAX_NUM_SEQS="8". */}}
{{- define "spindle.flagEnv" -}}
{{- range $flag, $value := . }}
- name: {{ printf "SPINDLE_%s" ($flag | upper | replace "-" "_") }}
  value: {{ include "spindle.str" $value | quote }}
{{- end }}
{{- end -}}

{{/* OpenTelemetry: the standard variables. Call with (list $ "spindle-gateway"). */}}
{{- define "spindle.otelEnv" -}}
{{- $ := index . 0 -}}{{- $otel := $.Values.otel -}}
- name: OTEL_SERVICE_NAME
  value: {{ index . 1 | quote }}
- name: K8S_POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "k8s.namespace.name=%s,k8s.pod.name=$(K8S_POD_NAME),service.namespace=%s" $.Release.Namespace $.Release.Name | quote }}
{{- if $otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $otel.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $otel.protocol | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $otel.sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $otel.samplerArg | quote }}
{{- end }}
- name: OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT
  value: {{ $otel.captureMessageContent | quote }}
{{- end -}}

{{/* grpc.health.v1 probes on a port: startup (may be long), readiness, liveness. */}}
{{- /* Readiness is GET /health on the OpenAI HTTP port when there is one in plaintext (what the
Gateway API Inference Extension and HTTP load balancers see too); grpc.health.v1 otherwise.
Call with (list PORT STARTUP_SECONDS DRAIN_SECONDS HTTP_READY OWN_HEALTH). OWN_HEALTH: the
status is the process' own (a model pod: loading, draining, a lost device). Else (the gateway:
no model pod in rotation; the adapter service: Redis or storage unreachable) it tracks what the
process depends on, which a restart does not mend: startup and liveness then only check that the
port accepts connections, so gateways are not killed while the model pods load (up to
model.probes.startupSeconds) nor all at once when the pods or Redis go away. */}}
{{- define "spindle.probes" -}}
{{- $port := index . 0 -}}{{- $startupSeconds := index . 1 -}}{{- $liveSeconds := index . 2 -}}
{{- $httpReady := index . 3 -}}{{- $ownHealth := index . 4 -}}
{{- $alive := ternary (printf "grpc: {port: %v}" $port) (printf "tcpSocket: {port: %v}" $port) $ownHealth -}}
startupProbe:
  {{ $alive }}
  periodSeconds: 5
  failureThreshold: {{ div $startupSeconds 5 | max 1 }}
readinessProbe:
  {{- if $httpReady }}
  httpGet: {path: /health, port: http}
  {{- else }}
  grpc: {port: {{ $port }}}
  {{- end }}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  {{ $alive }}
  periodSeconds: 10
  timeoutSeconds: 5
  # NOT_SERVING while draining must not get the pod killed before its drain timeout.
  failureThreshold: {{ div $liveSeconds 10 | add 1 | max 3 }}
{{- end -}}

{{- define "spindle.securityContext" -}}
{{ toYaml .Values.securityContext }}
{{- end -}}

{{/* Pull secrets and scheduling of a component's pods. Call with (list $ VALUES "gateway"). */}}
{{- define "spindle.podSpecCommon" -}}
{{- $ := index . 0 -}}{{- $c := index . 1 -}}
{{- with $.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with include "spindle.topologySpread" (list $ $c.topologySpreadConstraints (index . 2)) }}
topologySpreadConstraints:
  {{- . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The component's topologySpreadConstraints, each selecting the component's own pods unless it
names its labelSelector: a constraint counts only the pods its selector matches, so one without
spreads nothing. Call with (list $ CONSTRAINTS "gateway"). */}}
{{- define "spindle.topologySpread" -}}
{{- $ := index . 0 -}}
{{- $pods := include "spindle.selectorLabels" (list $ (index . 2)) | fromYaml -}}
{{- range index . 1 }}
{{- $spread := deepCopy . -}}
{{- if not $spread.labelSelector }}{{ $_ := set $spread "labelSelector" (dict "matchLabels" $pods) }}{{ end }}
{{- list $spread | toYaml | nindent 0 }}
{{- end }}
{{- end -}}

{{/* Addresses the services give each other. */}}
{{- define "spindle.modelHeadless" -}}
{{- printf "%s-headless.%s.svc.%s" (include "spindle.component" (list . "model")) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{- define "spindle.modelWorkloadKind" -}}
{{- if .Values.model.adapterCache.persistence -}}StatefulSet{{- else -}}Deployment{{- end -}}
{{- end -}}

{{- define "spindle.s3Secret" -}}
{{- default (include "spindle.component" (list . "s3")) .Values.s3.existingSecret -}}
{{- end -}}

{{/* S3 credentials for a container: keys from a Secret; nothing with IRSA (the web identity). */}}
{{- define "spindle.s3Env" -}}
{{- $s3 := .Values.s3 -}}
{{- if eq $s3.auth "secret" }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef: {name: {{ include "spindle.s3Secret" . }}, key: AWS_ACCESS_KEY_ID}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef: {name: {{ include "spindle.s3Secret" . }}, key: AWS_SECRET_ACCESS_KEY}
{{- end }}
{{- if $s3.region }}
- name: AWS_REGION
  value: {{ $s3.region | quote }}
{{- end }}
{{- if $s3.endpointUrl }}
- name: AWS_ENDPOINT_URL_S3
  value: {{ $s3.endpointUrl | quote }}
{{- end }}
{{- end -}}

{{/* TLS and the service token, the same for every Spindle container (docs/security.md).
Call with (list $ REQUIRE_CLIENT_CERT). */}}
{{- define "spindle.securityEnv" -}}
{{- $ := index . 0 -}}{{- $tls := $.Values.tls -}}
{{- if $tls.enabled }}
{{- if not $tls.existingSecret }}{{ fail "tls.enabled needs tls.existingSecret: a Secret with tls.crt, tls.key and ca.crt" }}{{ end }}
- name: SPINDLE_TLS_CERT_FILE
  value: /etc/spindle/tls/tls.crt
- name: SPINDLE_TLS_KEY_FILE
  value: /etc/spindle/tls/tls.key
- name: SPINDLE_TLS_CA_FILE
  value: /etc/spindle/tls/ca.crt
- name: SPINDLE_TLS_SERVER_NAME
  value: {{ $tls.serverName | quote }}
- name: SPINDLE_TLS_REQUIRE_CLIENT_CERT
  value: {{ index . 1 | toString | quote }}
- name: SPINDLE_HEALTH_PORT
  value: {{ $tls.healthPort | quote }}
{{- end }}
{{- if $.Values.controlToken.enabled }}
- name: SPINDLE_CONTROL_TOKEN_FILE
  value: /etc/spindle/control-token/token
{{- end }}
{{- end -}}

{{/* Whole Secrets as volumes (no subPath), so a rotated certificate or token reaches the files. */}}
{{- define "spindle.securityMounts" -}}
{{- if .Values.tls.enabled }}
- {name: tls, mountPath: /etc/spindle/tls, readOnly: true}
{{- end }}
{{- if .Values.controlToken.enabled }}
- {name: control-token, mountPath: /etc/spindle/control-token, readOnly: true}
{{- end }}
{{- end -}}

{{- define "spindle.securityVolumes" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret: {secretName: {{ .Values.tls.existingSecret }}}
{{- end }}
{{- if .Values.controlToken.enabled }}
- name: control-token
  secret: {secretName: {{ include "spindle.controlTokenSecret" . }}}
{{- end }}
{{- end -}}

{{/* The Responses API's reasoning-blob key (reasoningKey), for the gateway and the model pods,
which must share it: the Secret mounted whole, read-only, and --reasoning-key-file naming its key.
Nothing while reasoningKey.existingSecret is "". */}}
{{- define "spindle.reasoningKeyEnv" -}}
{{- with .Values.reasoningKey }}{{ if .existingSecret }}
- name: SPINDLE_REASONING_KEY_FILE
  value: {{ printf "/etc/spindle/reasoning-key/%s" .key | quote }}
{{- end }}{{ end }}
{{- end -}}

{{- define "spindle.reasoningKeyMount" -}}
{{- if .Values.reasoningKey.existingSecret }}
- {name: reasoning-key, mountPath: /etc/spindle/reasoning-key, readOnly: true}
{{- end }}
{{- end -}}

{{- define "spindle.reasoningKeyVolume" -}}
{{- with .Values.reasoningKey.existingSecret }}
- name: reasoning-key
  secret: {secretName: {{ . }}}
{{- end }}
{{- end -}}

{{- define "spindle.controlTokenSecret" -}}
{{- default (printf "%s-control-token" (include "spindle.fullname" .)) .Values.controlToken.existingSecret -}}
{{- end -}}

{{/* The port the kubelet probes: the service's own, or with TLS its plaintext health port. */}}
{{- define "spindle.probePort" -}}
{{- $ := index . 0 -}}
{{- ternary $.Values.tls.healthPort (index . 1) $.Values.tls.enabled -}}
{{- end -}}

{{/* The adapter service's replicas: `adapterService.replicas` where its storage is shared (S3, or
an existing claim, which must then be ReadWriteMany); one on the default emptyDir, which only one
pod can see (two would each keep their own adapters). */}}
{{- define "spindle.adapterServiceReplicas" -}}
{{- $a := .Values.adapterService -}}
{{- if or $a.s3.enabled $a.storage.existingClaim }}{{ $a.replicas }}{{ else }}{{ min $a.replicas 1 }}{{ end -}}
{{- end }}
