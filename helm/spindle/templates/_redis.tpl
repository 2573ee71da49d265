{{/* Where the adapter service finds Redis, and the Secret holding its password ("" = none). */}}
{{- define "spindle.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s.%s.svc.%s:6379/0" (include "spindle.component" (list . "redis")) .Release.Namespace .Values.clusterDomain -}}
{{- else -}}
{{- .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{- define "spindle.redisSecret" -}}
{{- if .Values.redis.enabled -}}
{{- default (include "spindle.component" (list . "redis")) .Values.redis.existingSecret -}}
{{- else -}}
{{- .Values.redis.external.existingSecret -}}
{{- end -}}
{{- end -}}

{{/* "true" when the gateway keeps Responses API responses in that Redis (the adapter service's:
the chart has one only with it), else "". */}}
{{- define "spindle.responsesInRedis" -}}
{{- $r := .Values.redis -}}
{{- if and .Values.gateway.responsesStoreRedis .Values.adapterService.enabled (or $r.enabled $r.external.url) -}}true{{- end -}}
{{- end -}}

{{- define "spindle.redisPasswordKey" -}}
{{- if .Values.redis.enabled -}}redis-password{{- else -}}{{ .Values.redis.external.passwordKey }}{{- end -}}
{{- end -}}
