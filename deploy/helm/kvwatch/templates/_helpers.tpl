{{- define "kvwatch.name" -}}kvwatch{{- end -}}
{{- define "kvwatch.fullname" -}}{{ .Release.Name | trunc 50 | trimSuffix "-" }}-kvwatch{{- end -}}
{{- define "kvwatch.labels" -}}
app.kubernetes.io/name: kvwatch
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}
{{- define "kvwatch.selector" -}}
app.kubernetes.io/name: kvwatch
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
