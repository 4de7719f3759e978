{{/* The chart's name, overridable. */}}
{{- define "idemgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release-qualified name, overridable with fullnameOverride. */}}
{{- define "idemgate.fullname" -}}
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

{{- define "idemgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Standard labels. */}}
{{- define "idemgate.labels" -}}
helm.sh/chart: {{ include "idemgate.chart" . }}
{{ include "idemgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: idemgate
{{- end }}

{{- define "idemgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "idemgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "idemgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "idemgate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "idemgate.secretName" -}}
{{- default (printf "%s-secrets" (include "idemgate.fullname" .)) .Values.secrets.existingSecret }}
{{- end }}

{{- define "idemgate.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* A scalar or a list as a TOML value. Helm reads YAML numbers as floats: whole ones are written as integers. */}}
{{- define "idemgate.tomlValue" -}}
{{- if kindIs "string" . }}{{ . | toJson }}
{{- else if kindIs "bool" . }}{{ . }}
{{- else if or (kindIs "float64" .) (kindIs "int" .) (kindIs "int64" .) }}{{- if eq (float64 .) (float64 (int64 .)) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- else if kindIs "slice" . }}[{{ range $i, $v := . }}{{ if $i }}, {{ end }}{{ include "idemgate.tomlValue" $v }}{{ end }}]
{{- else }}{{ fail (printf "cannot write %v as TOML" .) }}
{{- end }}
{{- end }}

{{/* A TOML table's key = value lines. */}}
{{- define "idemgate.tomlTable" -}}
{{- $lines := list }}
{{- range $key, $value := . }}
{{- $lines = append $lines (printf "%s = %s" $key (include "idemgate.tomlValue" $value)) }}
{{- end }}
{{- join "\n" $lines }}
{{- end }}

{{/* Environment shared by the gateway, the reconciler and the migrations: secrets by reference. */}}
{{- define "idemgate.env" -}}
- name: IDEMGATE_POSTGRES__URL
  valueFrom:
    secretKeyRef:
      name: {{ include "idemgate.secretName" . }}
      key: {{ .Values.secrets.keys.postgresUrl }}
{{- if .Values.redis.enabled }}
- name: IDEMGATE_REDIS__URL
  valueFrom:
    secretKeyRef:
      name: {{ include "idemgate.secretName" . }}
      key: {{ .Values.secrets.keys.redisUrl }}
{{- end }}
{{- if eq .Values.auth.mode "hs256" }}
- name: IDEMGATE_AUTH__HS256_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "idemgate.secretName" . }}
      key: {{ .Values.secrets.keys.jwtHs256Secret }}
{{- end }}
- name: IDEMGATE_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
{{- with .Values.otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- end }}

{{- define "idemgate.checksums" -}}
checksum/config: {{ include (print $.Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- if and .Values.secrets.create (not .Values.secrets.existingSecret) }}
checksum/secret: {{ include (print $.Template.BasePath "/secret.yaml") . | sha256sum }}
{{- end }}
{{- end }}
