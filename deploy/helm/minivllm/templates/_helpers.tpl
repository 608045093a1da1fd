{{/* Names and labels, as `helm create` spells them. */}}
{{- define "minivllm.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "minivllm.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "minivllm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "minivllm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: scheduler
{{- end -}}

{{- define "minivllm.labels" -}}
{{ include "minivllm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The last value engine.args give a flag (`--flag=N` or `--flag N`), else the default: vllm-serve's argparse
     lets the last one win too. Call: include "minivllm.flag" (list .Values.engine.args "--tensor-parallel-size" 1) */}}
{{- define "minivllm.flag" -}}
{{- $args := index . 0 -}}
{{- $flag := index . 1 -}}
{{- $value := toString (index . 2) -}}
{{- $next := false -}}
{{- range $args -}}
{{- $arg := toString . -}}
{{- if $next -}}
{{- $value = $arg -}}
{{- $next = false -}}
{{- else if eq $arg $flag -}}
{{- $next = true -}}
{{- else if hasPrefix (printf "%s=" $flag) $arg -}}
{{- $value = trimPrefix (printf "%s=" $flag) $arg -}}
{{- end -}}
{{- end -}}
{{- $value -}}
{{- end -}}

{{/* The GPUs of a world's pod: engine.resources.limits nvidia.com/gpu (0: a CPU world). */}}
{{- define "minivllm.gpus" -}}
{{- $limits := (.Values.engine.resources | default dict).limits | default dict -}}
{{- int (index $limits "nvidia.com/gpu" | default 0) -}}
{{- end -}}

{{/* Workers of one world, TP x PP from engine.args; fails when the pod's GPUs are not one per worker. */}}
{{- define "minivllm.workers" -}}
{{- $tp := include "minivllm.flag" (list .Values.engine.args "--tensor-parallel-size" 1) -}}
{{- $pp := include "minivllm.flag" (list .Values.engine.args "--pipeline-parallel-size" 1) -}}
{{- if not (regexMatch "^[1-9][0-9]*$" $tp) -}}
{{- fail (printf "engine.args: --tensor-parallel-size must be a positive integer, got %q" $tp) -}}
{{- end -}}
{{- if not (regexMatch "^[1-9][0-9]*$" $pp) -}}
{{- fail (printf "engine.args: --pipeline-parallel-size must be a positive integer, got %q" $pp) -}}
{{- end -}}
{{- $workers := mul (atoi $tp) (atoi $pp) -}}
{{- $gpus := int (include "minivllm.gpus" .) -}}
{{- if and (gt $gpus 0) (ne $gpus (int $workers)) -}}
{{- fail (printf "engine.resources.limits nvidia.com/gpu is %d, but engine.args start --tensor-parallel-size %s x --pipeline-parallel-size %s = %d workers, one GPU each: make them equal" $gpus $tp $pp $workers) -}}
{{- end -}}
{{- $workers -}}
{{- end -}}

{{- define "minivllm.image" -}}
{{- $tag := .Values.image.tag | default (ternary "cuda" "cpu" (gt (int (include "minivllm.gpus" .)) 0)) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
