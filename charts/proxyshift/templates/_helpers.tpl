{{/* The image every proxyshift container runs. */}}
{{- define "proxyshift.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/*
Labels Helm adds to every object's metadata besides config/'s own. Never in a selector: a selector
that names the chart version would make an upgrade's Deployment and DaemonSets immutable.
*/}}
{{- define "proxyshift.chartLabels" -}}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{/* A service account's user name, as the API server's admission sees it. */}}
{{- define "proxyshift.serviceAccountUser" -}}
system:serviceaccount:{{ .root.Release.Namespace }}:{{ .name }}
{{- end }}

{{/* imagePullPolicy and imagePullSecrets, only when set (the container default applies otherwise). */}}
{{- define "proxyshift.pullPolicy" -}}
{{- with .Values.image.pullPolicy }}
imagePullPolicy: {{ . }}
{{- end }}
{{- end }}
{{- define "proxyshift.pullSecrets" -}}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end }}
