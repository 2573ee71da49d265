{{/* The model pods' GPU table: values key -> the nvidia.com/gpu.product label that NVIDIA's GPU
feature discovery puts on nodes. values.schema.json lists the same keys. */}}
{{- define "spindle.gpuProducts" -}}
t4: Tesla-T4
l4: NVIDIA-L4
a10g: NVIDIA-A10G
l40s: NVIDIA-L40S
a100-40gb: NVIDIA-A100-SXM4-40GB
a100-80gb: NVIDIA-A100-SXM4-80GB
h100-80gb: NVIDIA-H100-80GB-HBM3
h200: NVIDIA-H200
{{- end -}}

{{/* What SPINDLE_MODEL names: an alias, a path on the PVC, or the fetched directory. */}}
{{- define "spindle.modelPath" -}}
{{- $src := .Values.model.source -}}
{{- if eq $src.type "builtin" -}}{{ $src.builtin }}
{{- else if eq $src.type "pvc" -}}{{ printf "/models/%s" $src.pvc.path | trimSuffix "/" }}
{{- else -}}/models/model
{{- end -}}
{{- end -}}

{{- define "spindle.modelResources" -}}
{{- $m := .Values.model -}}
{{- if eq $m.variant "gpu" -}}
{{- $r := deepCopy $m.gpu.resources -}}
{{- $_ := set $r "requests" (set (default (dict) $r.requests) "nvidia.com/gpu" $m.gpu.count) -}}
{{- $_ := set $r "limits" (set (default (dict) $r.limits) "nvidia.com/gpu" $m.gpu.count) -}}
{{- toYaml $r -}}
{{- else -}}
{{- toYaml $m.cpu.resources -}}
{{- end -}}
{{- end -}}

{{- define "spindle.modelNodeSelector" -}}
{{- $m := .Values.model -}}
{{- $sel := deepCopy $m.nodeSelector -}}
{{- if and (eq $m.variant "gpu") $m.gpu.type -}}
{{- $product := index (include "spindle.gpuProducts" . | fromYaml) $m.gpu.type -}}
{{- if not $product -}}{{- fail (printf "model.gpu.type %q is not a known GPU type" $m.gpu.type) -}}{{- end -}}
{{- $_ := set $sel "nvidia.com/gpu.product" $product -}}
{{- end -}}
{{- with $sel }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{/* The init container that syncs model.source.s3.uri into /models/model (an emptyDir `models`).
Call with (list $ NAME FILTER), FILTER: aws s3 sync arguments such as --exclude, or (list). */}}
{{- define "spindle.fetchModel" -}}
{{- $ := index . 0 -}}{{- $src := $.Values.model.source -}}
- name: {{ index . 1 }}
  image: {{ printf "%s:%s" $src.fetchImage.repository $src.fetchImage.tag }}
  imagePullPolicy: {{ $src.fetchImage.pullPolicy }}
  command: [aws, s3, sync, --only-show-errors, {{- range index . 2 }} {{ . | quote }},{{ end }} {{ $src.s3.uri | quote }}, /models/model]
  env:
    - {name: HOME, value: /tmp}
    {{- with include "spindle.s3Env" $ | trim }}{{ . | nindent 4 }}{{ end }}
  resources:
    requests: {cpu: 500m, memory: 512Mi}
    limits: {memory: 2Gi}
  securityContext:
    {{- include "spindle.securityContext" $ | nindent 4 }}
  volumeMounts:
    - {name: models, mountPath: /models}
    - {name: tmp, mountPath: /tmp}
{{- end -}}
